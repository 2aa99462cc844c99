"""The result file of bench/llama1b_side_by_side.sh: every run's `tessera bench serve --out` row
(WORK/r<round>-<server>-<all|c1>.json) with its round, its time and, for Tessera, its throughput
over vLLM-CPU's in the same round and its one-stream TPOT over the memory roofline
(WORK/roofline.json, `tessera bench roofline`); written as one `served` result file
(bench/render.py), and the medians against the target printed.

    .venv/bin/python bench/llama1b_results.py WORK [RESULT_FILE] [--command "how the script ran"]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import statistics

from tessera.bench import results
from tessera.cpu_kind import describe_cpu

TARGET_RATIO, TARGET_FRACTION = 1.3, 1.15      # the benchmark target: tok/s over vLLM-CPU; TPOT over the roofline
RUN = re.compile(r"r(\d+)-(.+)-(all|c1)\.json")


def runs(work: pathlib.Path) -> list[dict]:
    """Every run's row with round, round_utc and workload ('all' or 'c1') added, in round order."""
    out = []
    for f in sorted(work.glob("r*-*.json"), key=lambda f: (int(RUN.fullmatch(f.name)[1]), f.name)):
        m = RUN.fullmatch(f.name)
        if m is None:
            continue
        doc = json.loads(f.read_text())
        for row in doc["rows"]:
            out.append({**row, "round": int(m[1]), "round_utc": doc["date"][11:16], "workload": m[3]})
    return out


def annotate(rows: list[dict], roof: dict) -> None:
    """Tessera's rows get ratio_vs_vllm (all at once) and roofline_fraction (one stream)."""
    vllm = {r["round"]: r["output_tok_s"] for r in rows if r["server"] == "vllm-cpu" and r["workload"] == "all"}
    for r in rows:
        if r["server"] != "tessera":
            continue
        if r["workload"] == "all" and vllm.get(r["round"]):
            r["ratio_vs_vllm"] = round(r["output_tok_s"] / vllm[r["round"]], 3)
        if r["workload"] == "c1" and r.get("tpot_p50_ms"):
            r["roofline_tpot_ms"] = roof["roofline_tpot_ms"]
            r["roofline_fraction"] = round(r["tpot_p50_ms"] / roof["roofline_tpot_ms"], 3)


def _median(values) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return round(statistics.median(values), 3) if values else None


def summary(rows: list[dict], roof: dict) -> dict:
    tessera = [r for r in rows if r["server"] == "tessera"]
    ratio = _median(r.get("ratio_vs_vllm") for r in tessera)
    tpot = _median(r["tpot_p50_ms"] for r in tessera if r["workload"] == "c1")
    fraction = round(tpot / roof["roofline_tpot_ms"], 3) if tpot else None
    return {"rounds": len({r["round"] for r in rows}), "median_ratio_vs_vllm": ratio,
            "ratio_target": TARGET_RATIO, "ratio_met": ratio >= TARGET_RATIO if ratio else None,
            "one_stream_tpot_p50_ms": tpot, "roofline": roof, "roofline_fraction": fraction,
            "fraction_target": TARGET_FRACTION, "fraction_met": fraction <= TARGET_FRACTION if fraction else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("work")
    p.add_argument("result", nargs="?", default=None)
    p.add_argument("--command", default="bash bench/llama1b_side_by_side.sh")
    a = p.parse_args()
    work = pathlib.Path(a.work)
    roof = json.loads((work / "roofline.json").read_text())
    rows = runs(work)
    if not rows:
        raise SystemExit(f"no r<round>-<server>-<all|c1>.json runs in {work}")
    annotate(rows, roof)
    facts = summary(rows, roof)
    for r in rows:
        del r["workload"]
    model = json.loads((pathlib.Path(roof["model"]) / "config.json").read_text())
    title = (f"Llama 3.2 1B's architecture ({model['num_hidden_layers']} layers, hidden {model['hidden_size']}, random bf16 "
             f"weights, SmolLM2's vocabulary): Tessera against vLLM-CPU, {facts['rounds']} alternating rounds")
    notes = ("Round 1 runs Tessera first, round 2 vLLM-CPU first, and so on; each server starts fresh in each round and "
             "gets an untimed warm-up run. roofline_fraction: the one-stream TPOT p50 over the memory roofline "
             "(weight bytes per token / streaming-read bandwidth, details.roofline). "
             f"Medians: Tessera / vLLM-CPU {facts['median_ratio_vs_vllm'] or 'n/a '}x (target {TARGET_RATIO}x); one-stream "
             f"TPOT p50 {facts['one_stream_tpot_p50_ms']} ms = {facts['roofline_fraction']}x the roofline's "
             f"{roof['roofline_tpot_ms']} ms ({roof['weight_bytes_per_token'] / 1e9:.3f} GB per token at "
             f"{roof['bandwidth_gbs']} GB/s read on {roof['threads']} threads; target {TARGET_FRACTION}x).")
    doc = results.document("served", title, rows, notes=notes,
                           details={"target": facts, "model_config": model, "script": a.command})
    doc["command"] = a.command
    if os.environ.get("VLLM_VERSION"):
        doc["versions"]["vllm"] = os.environ["VLLM_VERSION"]
    now = datetime.datetime.now(datetime.timezone.utc)
    path = a.result or f"bench/results/served-{describe_cpu()['kind']}-{now:%Y-%m-%d}-llama1b.json"
    if not a.result and os.path.exists(path):      # a second run the same day: a file of its own
        path = path.replace(".json", f"-{now:%H%M}.json")
    print(f"wrote {results.write(path, doc)}")
    print(json.dumps({k: v for k, v in facts.items() if k != "roofline"}))


if __name__ == "__main__":
    main()
