"""`tessera bench afd`: decode throughput of attention-FFN disaggregation on a tiny MoE.

This process is the attention node, pinned to core 0 with one thread; one expert node runs
as a separate process pinned to core 1 with one thread. For m = 1, 2, 3 micro-batches it
measures decode throughput at a fixed batch (prefill excluded), the per-layer times T_a
(attention halves of one micro-batch, with dispatch), T_e (one expert computation of one
micro-batch) and T_c (one direction of communication for one micro-batch, derived from the
attention side's wait: wait = 2 T_c + T_e per layer and micro-batch when nothing overlaps,
so only the m = 1 row gives it), and each side's idle fraction. The monolithic engine runs
the same decode with two threads on both cores. Every number here is measured, except
simulated_ms: the discrete-event simulator's prediction for each row, fed by m = 1 runs at
each micro-batch size (B, B/2, B/3) measured right after the timed rows, or by --profile. (A
profile taken minutes apart drifts by up to 20% on a shared VM; back to back it does not.)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

BENCH_MODEL = "random:mixtral:hidden_size=1024,intermediate_size=512,num_hidden_layers=4,vocab_size=4096"


def add_args(p) -> None:
    p.add_argument("--model", default=BENCH_MODEL)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=48, help="decode steps timed per configuration")
    p.add_argument("--micro-batches", default="1,2,3")
    p.add_argument("--transport", default="auto", choices=["auto", "nixl", "tcp"])
    p.add_argument("--json", action="store_true")
    p.add_argument("--profile", default=None,
                   help="a `tessera profile` JSON for the simulator (default: calibrate here, m = 1 runs at "
                        "each micro-batch size right after the timed rows)")


def timed_decode(engine, batch: int, prompt_len: int, steps: int, probe=lambda: None):
    """(seconds, probe() before, probe() after) for `steps` decode steps of `batch` running
    requests; prefill and the final drain fall outside the window."""
    import torch

    from tessera.config import SamplingParams
    g = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    sampling = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(3, vocab, (prompt_len,), generator=g).tolist(), sampling)
    started: set[str] = set()
    while len(started) < batch:
        started |= {o.request_id for o in engine.step() if o.new_token_ids}
    first = probe()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - t0
    last = probe()
    while engine.has_unfinished:
        engine.step()
    return elapsed, first, last


def _engine_config(a, threads: int):
    from tessera.config import CacheConfig, EngineConfig, SchedulerConfig
    return EngineConfig(model=a.model, dtype="float32", num_threads=threads,
                        cache=CacheConfig(block_size=16, num_blocks=1024),
                        scheduler=SchedulerConfig(max_num_seqs=a.batch, max_num_batched_tokens=1024))


def _expert_process(a, port: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "tessera.cli", "expert-node", "--model", a.model, "--dtype", "float32",
            "--threads", "1", "--port", str(port), "--transport", a.transport]
    # Its "ready" line goes to stderr: stdout carries only our --json.
    return subprocess.Popen(argv, stdout=sys.stderr, preexec_fn=lambda: os.sched_setaffinity(0, {1}))


def afd_row(a, m: int, address: str) -> dict:
    """One AFD configuration; per-layer times are per micro-batch (of batch / m tokens)."""
    from tessera.config import AfdConfig
    from tessera.disagg.attention_node import build_attention_engine
    from tessera.rpc.expert_client import GrpcExpertControl
    control = GrpcExpertControl(address)
    engine = build_attention_engine(_engine_config(a, 1), AfdConfig(
        name=f"bench-attention-m{m}-b{a.batch}", expert_nodes=(address,), transport=a.transport, micro_batches=m,
        connect_wait_s=120), [control])
    runner = engine.runner
    timed_decode(engine, a.batch, a.prompt_len, 4)                  # warm-up
    elapsed, (before, attn0, wait0), (after, attn1, wait1) = timed_decode(
        engine, a.batch, a.prompt_len, a.steps, lambda: (control.info(), runner.attn_s, runner.wait_s))
    layers = engine.model_config.num_layers
    expert_s, batches = after.compute_s - before.compute_s, after.batches - before.batches
    t_e = expert_s / max(1, batches)           # per micro-batch and layer
    t_a = (attn1 - attn0) / max(1, batches)
    wait = (wait1 - wait0) / max(1, batches)
    runner.stop_experts()
    # Close this configuration's endpoint: a transport left open keeps its progress thread
    # polling on the attention core through every later measurement.
    runner.transport.close()
    control.close()
    return {"mode": "afd", "micro_batches": m, "output_tok_s": round(a.batch * a.steps / elapsed, 1),
            "iteration_ms": round(1e3 * elapsed / a.steps, 2), "layers": layers,
            "t_a_ms": round(1e3 * t_a, 3), "t_e_ms": round(1e3 * t_e, 3),
            "t_c_ms": round(1e3 * max(0.0, wait - t_e) / 2, 3) if m == 1 else None,
            "t_o_ms": round(1e3 * (elapsed - (attn1 - attn0) - (wait1 - wait0)) / a.steps, 3),
            "attention_idle": round(min(1.0, (wait1 - wait0) / elapsed), 3),
            "expert_idle": round(max(0.0, 1 - expert_s / elapsed), 3)}


def main(a) -> int:
    import torch

    from tessera.engine import Engine
    from tessera.models.loader import resolve_model_path
    resolve_model_path(a.model)
    mono = Engine(_engine_config(a, 2))
    timed_decode(mono, a.batch, a.prompt_len, 4)
    elapsed = timed_decode(mono, a.batch, a.prompt_len, a.steps)[0]
    rows = [{"mode": "monolithic", "output_tok_s": round(a.batch * a.steps / elapsed, 1),
             "iteration_ms": round(1e3 * elapsed / a.steps, 2), "threads": 2}]
    del mono
    from tessera.bench.m2n_bench import _free_port
    from tessera.disagg.profile import build_profile, load_profile, profile_model, profile_row
    from tessera.disagg.simulator import simulate
    port = _free_port()
    expert = _expert_process(a, port)
    micro_batches = [int(x) for x in a.micro_batches.split(",")]
    try:
        os.sched_setaffinity(0, {0})
        torch.set_num_threads(1)
        address = f"127.0.0.1:{port}"
        for m in micro_batches:
            rows.append(afd_row(a, m, address))
            if not a.json:
                print(rows[-1], flush=True)
        if not a.profile:   # calibrate: m = 1 at every micro-batch size, right after the rows
            measured = [profile_row(a.batch, r) for r in rows[1:] if r["micro_batches"] == 1]
            sizes = sorted({-(-a.batch // m) for m in micro_batches} - {r["batch"] for r in measured})
            measured += [profile_row(b, afd_row(argparse.Namespace(**{**vars(a), "batch": b}), 1, address))
                         for b in sizes]
    finally:
        expert.terminate()
        expert.wait(timeout=20)
    model = load_profile(a.profile) if a.profile else profile_model(build_profile(measured, rows[1]["layers"]))
    for r in rows[1:]:
        r["simulated_ms"] = round(1e3 * simulate(model, a.batch, r["micro_batches"]), 2)
        r["simulation_error"] = round(r["simulated_ms"] / r["iteration_ms"] - 1, 3)
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        print(rows[0])
    return 0
