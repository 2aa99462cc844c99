"""Fixed-batch decode measurements of AFD, shared by `tessera profile` and `tessera bench afd`.

This process is the attention node (core 0, one thread); one expert node runs as a separate
process (core 1, one thread). A window is B requests decoding together: the KV cache holds
all of them for prefill, warm-up and window, max_tokens outlasts the window, EOS is ignored,
and the tokens counted are those the engine emitted. A window in which a request was
preempted, finished or was not running fails the run (FixedBatchError): its numbers would
not be fixed-batch decode.
"""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

BENCH_MODEL = "random:mixtral:hidden_size=1024,intermediate_size=512,num_hidden_layers=4,vocab_size=4096"
BLOCK_SIZE = 16
WARMUP_STEPS = 4


class FixedBatchError(RuntimeError):
    """The timed window was not B requests decoding together."""


@dataclass(frozen=True)
class Window:
    batch: int
    prompt_len: int
    steps: int                 # decode steps timed
    warmup: int = WARMUP_STEPS

    @property
    def token_budget(self) -> int:
        """Tokens per step: above B, so prefill advances while the started requests decode."""
        return max(1024, 2 * self.batch)

    @property
    def max_tokens(self) -> int:
        """More than a request can emit by the end of the window: one per prefill step (at
        most B * prompt_len / (budget - B) + 1 of them), warm-up step and timed step."""
        prefill_steps = -(-self.batch * self.prompt_len // (self.token_budget - self.batch)) + 1
        return prefill_steps + self.warmup + self.steps + 1

    @property
    def num_blocks(self) -> int:
        """Every request at its longest, so nothing is preempted for lack of blocks."""
        return self.batch * -(-(self.prompt_len + self.max_tokens) // BLOCK_SIZE)


def engine_config(model: str, window: Window, threads: int | None):
    from tessera.config import CacheConfig, EngineConfig, SchedulerConfig
    return EngineConfig(model=model, dtype="float32", num_threads=threads,
                        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=window.num_blocks),
                        scheduler=SchedulerConfig(max_num_seqs=window.batch,
                                                  max_num_batched_tokens=window.token_budget))


def _preemptions(engine) -> int:
    return sum(r.num_preemptions for r in engine.scheduler.requests.values())


def _check_fixed(engine, window: Window, when: str) -> None:
    running, waiting = len(engine.scheduler.running), len(engine.scheduler.waiting)
    if running != window.batch or waiting:
        raise FixedBatchError(f"{when}: {running} of {window.batch} requests running, {waiting} waiting")


def timed_decode(engine, window: Window, probe=lambda: None) -> tuple[float, int, object, object]:
    """(seconds, tokens emitted, probe() before, probe() after) for `window.steps` decode steps
    of B running requests; prefill and warm-up fall before the window, and the requests are
    aborted after it (draining them would only cost time)."""
    import torch

    from tessera.config import SamplingParams
    g = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    sampling = SamplingParams(temperature=0, max_tokens=window.max_tokens, ignore_eos=True)
    ids = [engine.add_request(torch.randint(3, vocab, (window.prompt_len,), generator=g).tolist(), sampling)
           for _ in range(window.batch)]
    started: set[str] = set()
    while len(started) < window.batch:
        started |= {o.request_id for o in engine.step() if o.new_token_ids}
    for _ in range(window.warmup):
        engine.step()
    _check_fixed(engine, window, "at the start of the window")
    preempted, first = _preemptions(engine), probe()
    emitted, finished = 0, 0
    t0 = time.perf_counter()
    for _ in range(window.steps):
        for out in engine.step():
            emitted += len(out.new_token_ids)
            finished += out.finished
    elapsed = time.perf_counter() - t0
    last = probe()
    preempted = _preemptions(engine) - preempted
    for rid in ids:
        engine.abort(rid)
    if preempted or finished:
        raise FixedBatchError(f"{preempted} preemption(s) and {finished} finished request(s) inside the "
                              f"timed window (batch {window.batch}): the KV cache or max_tokens is too small")
    return elapsed, emitted, first, last


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expert_process(model: str, port: int, transport: str) -> subprocess.Popen:
    """One expert node with one thread, pinned to core 1."""
    argv = [sys.executable, "-m", "tessera.cli", "expert-node", "--model", model, "--dtype", "float32",
            "--threads", "1", "--port", str(port), "--transport", transport]
    # Its "ready" line goes to stderr: stdout carries only the bench's --json.
    return subprocess.Popen(argv, stdout=sys.stderr, preexec_fn=lambda: os.sched_setaffinity(0, {1}))


def stop_process(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def expert_node(model: str, transport: str):
    """An expert process on core 1 for the block; this process moves to core 0, one thread.
    Yields the expert node's gRPC address."""
    import torch
    port = free_port()
    proc = expert_process(model, port, transport)
    try:
        os.sched_setaffinity(0, {0})
        torch.set_num_threads(1)
        yield f"127.0.0.1:{port}"
    finally:
        stop_process(proc)


def monolithic_row(model: str, window: Window) -> dict:
    """The same decode window on the monolithic engine with two threads on both cores."""
    from tessera.engine import Engine
    elapsed, emitted, _, _ = timed_decode(Engine(engine_config(model, window, 2)), window)
    return {"mode": "monolithic", "batch": window.batch, "output_tokens": emitted,
            "output_tok_s": round(emitted / elapsed, 1), "iteration_ms": round(1e3 * elapsed / window.steps, 2),
            "threads": 2}


def afd_row(model: str, window: Window, m: int, address: str, transport: str) -> dict:
    """One AFD configuration; per-layer times are per micro-batch (of about B / m tokens) and
    layer: T_a attention half with dispatch, T_e one expert computation, T_c one direction of
    communication (from the attention side's wait, 2 T_c + T_e when nothing overlaps: only
    m = 1 gives it), T_o the step outside the layers."""
    from tessera.config import AfdConfig
    from tessera.disagg.attention_node import build_attention_engine
    from tessera.rpc.expert_client import GrpcExpertControl
    control = GrpcExpertControl(address)
    engine = build_attention_engine(engine_config(model, window, 1), AfdConfig(
        name=f"measure-attention-m{m}-b{window.batch}", expert_nodes=(address,), transport=transport,
        micro_batches=m, connect_wait_s=120), [control])
    runner = engine.runner
    try:
        elapsed, emitted, (before, attn0, wait0), (after, attn1, wait1) = timed_decode(
            engine, window, lambda: (control.info(), runner.attn_s, runner.wait_s))
    finally:
        runner.stop_experts()
        # A transport left open keeps its progress thread polling on the attention core
        # through every later measurement.
        runner.transport.close()
        control.close()
    expert_s, batches = after.compute_s - before.compute_s, max(1, after.batches - before.batches)
    attn, wait = attn1 - attn0, wait1 - wait0
    t_e = expert_s / batches
    return {"mode": "afd", "micro_batches": m, "batch": window.batch, "output_tokens": emitted,
            "output_tok_s": round(emitted / elapsed, 1), "iteration_ms": round(1e3 * elapsed / window.steps, 2),
            "layers": engine.model_config.num_layers, "preemptions": 0,
            "t_a_ms": round(1e3 * attn / batches, 3), "t_e_ms": round(1e3 * t_e, 3),
            "t_c_ms": round(1e3 * max(0.0, wait / batches - t_e) / 2, 3) if m == 1 else None,
            "t_o_ms": round(1e3 * (elapsed - attn - wait) / window.steps, 3),
            "attention_idle": round(min(1.0, wait / elapsed), 3),
            "expert_idle": round(max(0.0, 1 - expert_s / elapsed), 3)}
