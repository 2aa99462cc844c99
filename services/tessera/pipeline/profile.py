"""`tessera profile pq`: the latency profile of one device type (this CPU at --threads) for the
LLM-PQ planner (docs/design/pipeline.md#latency-model): decoder layers timed per bit-width for
prefill and decode, fitted per bit-width (costmodel.Regression; decode one per kernel regime,
costmodel.Piecewise), plus the embedding and head; held-out points report the fits' error
(docs/design/pipeline.md#invariants, rule 4). Timed as a stage runs: weights cold, beside busy
neighbours (docs/design/pipeline.md#profiling).
"""
from __future__ import annotations

import contextlib
import itertools
import json
import multiprocessing
import os
import pathlib
import random
import statistics
import time

from tessera.machine_profiles import recorded_machine

PREFILL = [(b, s) for b in (1, 2, 4, 8, 16) for s in (32, 64, 128)]
# b on both sides of every kernel change (layers/quant.py: decode_regimes: 2, 4 and 16 rows here)
DECODE = [(b, s, i) for b in (1, 2, 3, 4, 5, 6, 8, 12, 16, 17, 20, 32, 48, 64)
          for s, i in ((32, 0), (32, 96), (128, 0), (128, 96))]
HELD_PREFILL = [(3, 48), (6, 96), (12, 80)]
HELD_DECODE = [(1, 80, 40), (2, 64, 32), (5, 40, 24), (8, 96, 48), (24, 48, 64), (40, 80, 8)]
PREPOST_PREFILL = [(b, s) for b in (1, 4, 16) for s in (32, 128)]
PREPOST_DECODE = [1, 4, 16, 32]
BLOCK = 16


def add_args(p) -> None:
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out", default="pq-profile.json")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (the device type measured)")
    p.add_argument("--bits", default="16,8,4", help="bit-widths to profile (16: unquantized)")
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--reps", type=int, default=7, help="timed runs per prefill point (median); decode runs 3x")
    p.add_argument("--neighbours", type=int, default=None,
                   help="processes running layers beside the timed one (default: cores // threads - 1, "
                        "the machine's other cores as devices of this type)")


def step_batch(b: int, s: int, i: int, prefill: bool):
    """(ForwardBatch, KV slots it needs): b requests of s prompt tokens (prefill), or of one
    token after s + i tokens of context (decode), each with its own blocks."""
    from tessera.batch import build_forward_batch
    from tessera.scheduler import ScheduledRequest, StepPlan
    blocks = -(-(s + i + 1) // BLOCK)
    reqs = []
    for r in range(b):
        table = tuple(range(r * blocks, (r + 1) * blocks))
        tokens, start = ((1,) * s, 0) if prefill else ((1,), s + i)
        reqs.append(ScheduledRequest(str(r), tokens, start, table, True))
    return build_forward_batch(StepPlan(tuple(reqs)), BLOCK), b * blocks * BLOCK


_next_layer = itertools.count()   # across points too: a point must not find the last one's layers cached


def time_layer(model, b: int, s: int, i: int, prefill: bool, reps: int) -> float:
    """Median seconds of one decoder layer on that batch (after one warm-up run). Each run takes
    the next layer of the model (all at one bit-width; layers share one shape), so its weights come
    from memory as in a stage of many layers: one layer timed again and again keeps them in L2/L3
    and decodes markedly faster than it does in a stack (docs/design/pipeline.md#profiling)."""
    import torch

    from tessera.models.driver import run_layers
    cfg, dtype = model.config, model.embed_tokens.weight.dtype
    batch, slots = step_batch(b, s, i, prefill)
    kv = [tuple(torch.zeros(cfg.num_kv_heads, slots, cfg.head_dim, dtype=dtype) for _ in range(2))
          for _ in range(cfg.num_layers)]
    x = torch.randn(batch.num_tokens, cfg.hidden_size, dtype=dtype)
    samples = []
    with torch.inference_mode():
        for r in range(reps + 1):
            layer = next(_next_layer) % cfg.num_layers
            t0 = time.perf_counter()
            run_layers(model, x, batch, kv, range(layer, layer + 1))
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples[1:])


def time_prepost(model, b: int, s: int, reps: int) -> float:
    """Median seconds of stage 0's ends for b sequences of s new tokens: the embedding of b·s
    tokens, then the final norm and LM head of the b last ones."""
    import torch
    ids = torch.ones(b * s, dtype=torch.long)
    last = torch.arange(s - 1, b * s, s)
    samples = []
    with torch.inference_mode():
        for r in range(reps + 1):
            t0 = time.perf_counter()
            x = model.embed_tokens(ids)
            model.compute_logits(model.norm(x[last]))
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples[1:])


def _neighbour(model_name: str, bits: int, group_size: int, dtype: str, threads: int, ready) -> None:
    """A busy device beside the timed one: the model at `bits` through its decoder layers on a
    decode step of 4 rows, over and over, until killed or its parent is gone.

    The virtual devices are cores of one machine, and in a pipeline they all stream weights at
    once from the memory they share: a layer's decode beside a busy neighbour slows down, by an
    amount that depends on its bit-width (16-bit layers, which read the most, the most). Plans
    differ in this as in their bits, so a per-step overhead measured on a 16-bit reference could
    not carry it. Spawned, not
    forked: OpenMP does not survive a fork."""
    import torch

    from tessera.layers.quant import quantize_model
    from tessera.models.driver import run_layers
    from tessera.models.loader import load_model
    torch.set_num_threads(threads)
    model, cfg = load_model(model_name, getattr(torch, dtype))
    quantize_model(model, [bits] * cfg.num_layers, group_size=group_size)
    batch, slots = step_batch(4, 64, 32, False)
    kv = [tuple(torch.zeros(cfg.num_kv_heads, slots, cfg.head_dim, dtype=getattr(torch, dtype)) for _ in range(2))
          for _ in range(cfg.num_layers)]
    x = torch.randn(batch.num_tokens, cfg.hidden_size, dtype=getattr(torch, dtype))
    parent = os.getppid()
    with torch.inference_mode():
        run_layers(model, x, batch, kv, range(cfg.num_layers))
        ready.set()
        while os.getppid() == parent:       # a profile killed hard must not leave this spinning
            run_layers(model, x, batch, kv, range(cfg.num_layers))


@contextlib.contextmanager
def busy_neighbours(count: int, *args):
    """`count` processes running _neighbour(*args), each past its first step when this yields."""
    ctx = multiprocessing.get_context("spawn")
    ready = [ctx.Event() for _ in range(count)]
    procs = [ctx.Process(target=_neighbour, args=(*args, r), daemon=True) for r in ready]
    for proc in procs:
        proc.start()
    try:
        for proc, r in zip(procs, ready):
            while not r.wait(1.0):
                if not proc.is_alive():
                    raise RuntimeError(f"a busy neighbour exited ({proc.exitcode}) before its first step")
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.join()


def measure(model_at, bits: list[int], reps: int, log=print, neighbour=lambda bits: (0,)) -> dict:
    """Every profiled and held-out point: {phase: [{bits, b, s, i, seconds}]}; model_at(bits) is
    the model with every layer at that bit-width, timed beside busy_neighbours(*neighbour(bits))."""
    out: dict[str, list[dict]] = {"prefill": [], "decode": [], "held_prefill": [], "held_decode": []}
    order = random.Random(0)
    for bw in bits:
        model = model_at(bw)
        for b, s, prefill in ((2, 16, True), (1, 16, False)):   # one-off work on a layer's first call
            time_layer(model, b, s, 0, prefill, model.config.num_layers)     # (oneDNN's weight reorder)
        with busy_neighbours(*neighbour(bw)):
            _measure_bits(model, bw, reps, order, out)
            if bw == bits[-1]:       # the ends have no bits (timed beside the last bit-width's neighbours)
                out["prepost_prefill"] = [{"b": b, "s": s, "i": 0, "seconds": time_prepost(model, b, s, reps)}
                                          for b, s in PREPOST_PREFILL]
                out["prepost_decode"] = [{"b": b, "s": 1, "i": 0, "seconds": time_prepost(model, b, 1, 3 * reps)}
                                         for b in PREPOST_DECODE]
        log(f"bits {bw}: {len(PREFILL) + len(HELD_PREFILL)} prefill and {len(DECODE) + len(HELD_DECODE)} "
            f"decode points timed beside {neighbour(bw)[0]} busy neighbour(s)")
    return out


def _measure_bits(model, bw: int, reps: int, order: random.Random, out: dict) -> None:
    # fitted and held-out points interleaved: a minute of the machine's drift then moves
    # both alike instead of landing on the held-out points as a model error
    for fit, held, prefill, runs in (("prefill", "held_prefill", True, reps), ("decode", "held_decode", False, 3 * reps)):
        points = [(phase, p) for phase, sizes in ((fit, PREFILL if prefill else DECODE),
                                                  (held, HELD_PREFILL if prefill else HELD_DECODE))
                  for p in sizes]
        order.shuffle(points)
        for phase, (b, s, *rest) in points:
            i = rest[0] if rest else 0
            t = time_layer(model, b, s, i, prefill, runs)
            out[phase].append({"bits": bw, "b": b, "s": s, "i": i, "seconds": t})


def fit_points(points: dict, bits: list[int], regimes: dict[int, tuple[tuple[int, int], ...]]) -> dict:
    """The regressions of every bit-width (decode: one per kernel regime, regimes[bits] as
    layers/quant.py's decode_regimes), the pre/post fits, and the held-out errors."""
    from tessera.pipeline.costmodel import Piecewise, Regression

    def pts(rows, bw=None):
        return [(r["b"], r["s"], r["i"], r["seconds"]) for r in rows if bw is None or r["bits"] == bw]
    fits = {str(bw): {"prefill": Regression.fit("prefill", pts(points["prefill"], bw)).to_dict(),
                      "decode": Piecewise.fit("decode", pts(points["decode"], bw), regimes.get(bw, ((0, 1),))).to_dict()}
            for bw in bits}
    fitted = {ph: {bw: (Regression if ph == "prefill" else Piecewise).from_dict(fits[str(bw)][ph]) for bw in bits}
              for ph in ("prefill", "decode")}
    prepost = {ph: Regression.fit(f"prepost_{ph}", pts(points[f"prepost_{ph}"])).to_dict()
               for ph in ("prefill", "decode")}
    held = []
    for ph in ("prefill", "decode"):
        for r in points[f"held_{ph}"]:
            pred = fitted[ph][r["bits"]].predict(r["b"], r["s"], r["i"])
            held.append({**r, "phase": ph, "predicted": pred, "error_pct": 100 * (pred - r["seconds"]) / r["seconds"]})
    errors = [abs(h["error_pct"]) for h in held]
    return {"fits": fits, "prepost": prepost, "held_out": held,
            "held_out_error_pct": {"mean_abs": statistics.mean(errors), "max_abs": max(errors)}}


def remake_command(profile: dict) -> str:
    """The command that measures `profile` again on this machine."""
    return (f"tessera profile-pq --model {profile['model']} --threads {profile['threads']} "
            f"--bits {','.join(str(b) for b in profile['bits'])} --group-size {profile['group_size']}")


def cpu_name() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main(a) -> int:
    import torch

    from tessera.layers.quant import decode_regimes, quantize_model
    from tessera.models.loader import load_model
    from tessera.pipeline.costmodel import PROFILE_DTYPE
    bits = [int(b) for b in a.bits.split(",")]
    if not bits or not set(bits) <= {3, 4, 8, 16}:
        raise SystemExit("--bits: some of 3, 4, 8, 16")
    torch.set_num_threads(a.threads)
    start = time.perf_counter()
    dtype = getattr(torch, PROFILE_DTYPE)   # not --dtype auto's pick: see PROFILE_DTYPE

    def model_at(bw: int):
        model, cfg = load_model(a.model, dtype)
        quantize_model(model, [bw] * cfg.num_layers, group_size=a.group_size)
        return model
    threads_left = len(os.sched_getaffinity(0)) - a.threads
    neighbours = a.neighbours if a.neighbours is not None else max(0, threads_left // a.threads)
    points = measure(model_at, bits, a.reps,
                     neighbour=lambda bw: (neighbours, a.model, bw, a.group_size, PROFILE_DTYPE, a.threads))
    profile = {"kind": "tessera pq profile", "model": a.model, "dtype": str(dtype).removeprefix("torch."),
               "cpu": cpu_name(), "machine": recorded_machine(), "threads": a.threads, "cores_allowed": len(os.sched_getaffinity(0)),
               "busy_neighbours": neighbours,
               "group_size": a.group_size, "bits": bits, "points": points,
               **fit_points(points, bits, {bw: decode_regimes(bw, dtype) for bw in bits})}
    profile["profile_s"] = round(time.perf_counter() - start, 1)
    pathlib.Path(a.out).write_text(json.dumps(profile, indent=1))
    err = profile["held_out_error_pct"]
    print(f"wrote {a.out} ({profile['cpu']}, {a.threads} thread(s), {profile['profile_s']} s): held-out error "
          f"mean {err['mean_abs']:.1f} %, max {err['max_abs']:.1f} % over {len(profile['held_out'])} points")
    for h in profile["held_out"]:
        print(f"  {h['phase']:7s} bits {h['bits']:2d} b={h['b']:2d} s={h['s']:3d} i={h['i']:2d}: measured "
              f"{h['seconds'] * 1e3:7.3f} ms, predicted {h['predicted'] * 1e3:7.3f} ms ({h['error_pct']:+.1f} %)")
    return 0
