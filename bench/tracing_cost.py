"""What tracing costs a served model: `tessera serve` with tracing off, with tracing on (every
request sampled, spans exported over OTLP/gRPC to a receiver in this process), and, with
--before REF, the code at a commit before tracing existed, in alternating rounds (round 1:
before, off, on; round 2: on, off, before; ...), each round on a fresh server. Every run is
`tessera bench serve` with CONCURRENCY streams (random-token prompts, ignore_eos, greedy),
after an untimed warm-up.

    .venv/bin/python bench/tracing_cost.py [--rounds 3] [--concurrency 16] [--num-prompts 64]
        [--before 6930fc2] [--out bench/results/F.json]

Prints one line per run and the medians: tracing on / off and off / before (output throughput),
as a ratio of the medians and as the median of each round's ratio (paired).
The receiver counts the spans it got in each run (seven per request at the request level, once
the batch processor has sent its last batch: the count is taken 6 s after the run).
--before REF checks REF out as a git worktree under /tmp (bench/ab_commits.py's) and runs it there.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

from ab_commits import worktree
from load_curve import ROOT, free_port, point, wait_up
from result_file import save
from tessera.bench.span_sink import SpanSink

PY = sys.executable


def serve(variant: str, tree: pathlib.Path, receiver: SpanSink) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [PY, "-m", "tessera.cli", "serve", "--dtype", "bfloat16", "--port", str(port),
            "--worker-port", str(free_port()), "--max-model-len", "1024"]
    env = dict(os.environ, OTEL_TRACES_SAMPLER="always_on")
    if variant == "on":
        argv += ["--otlp-traces-endpoint", receiver.endpoint]
    if tree != ROOT:        # the old code first on the path, ahead of the editable install
        env["PYTHONPATH"] = f"{tree}/services:{tree}/kernels"
    proc = subprocess.Popen(argv, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_up(url, proc)
    return proc, url


def paired(rows: list[dict], a: str, b: str) -> float:
    """The median over rounds of a's throughput over b's in the same round: the machine's drift
    between rounds (often wider than the effect) cancels within a round."""
    tok = {(r["round"], r["variant"]): r["output_tok_s"] for r in rows}
    return round(statistics.median(tok[n, a] / tok[n, b] for n, _ in tok if _ == a), 3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--before", default=None, help="a commit before tracing, run as a third variant")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    trees = {"off": ROOT, "on": ROOT}
    if a.before:
        trees = {"before": worktree(a.before), **trees}
    receiver = SpanSink(keep=False)
    rows = []
    for r in range(a.rounds):
        for variant in list(trees) if r % 2 == 0 else list(trees)[::-1]:
            proc, url = serve(variant, trees[variant], receiver)
            try:
                point(url, 4, seed=7, a=argparse.Namespace(num_prompts=4, input_len=a.input_len, output_len=16))
                spans_before = receiver.count
                res = point(url, a.concurrency, seed=1000 * (r + 1), a=a)
                if variant == "on":     # the last batch of spans leaves within OTEL_BSP_SCHEDULE_DELAY (5 s)
                    time.sleep(6.0)
            finally:
                os.killpg(proc.pid, 15)
                proc.wait(120)
            row = {"round": r + 1, "round_utc": time.strftime("%H:%M:%S", time.gmtime()), "variant": variant,
                   "concurrency": a.concurrency, "num_prompts": res["num_prompts"], "input_len": a.input_len,
                   "output_len": a.output_len, "output_tok_s": res["output_tok_s"],
                   "tpot_p50_ms": res["tpot_ms"]["p50"], "ttft_p50_ms": res["ttft_ms"]["p50"],
                   "failed": res["failed"], "spans_exported": receiver.count - spans_before}
            print(json.dumps(row), flush=True)
            rows.append(row)
    med = {v: statistics.median(r["output_tok_s"] for r in rows if r["variant"] == v) for v in trees}
    summary = {f"{v}_output_tok_s": round(t, 1) for v, t in med.items()}
    summary["on_vs_off"] = round(med["on"] / med["off"], 3)
    summary["on_vs_off_paired"] = paired(rows, "on", "off")
    if "before" in med:
        summary["off_vs_before"] = round(med["off"] / med["before"], 3)
        summary["off_vs_before_paired"] = paired(rows, "off", "before")
    print(json.dumps(summary))
    save(a.out, "tracing", f"Tracing cost: tessera serve bf16, {a.concurrency} streams, {a.input_len}/"
         f"{a.output_len}, {a.rounds} alternating rounds", rows, details={"medians": summary,
                                                                           "before": a.before})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
