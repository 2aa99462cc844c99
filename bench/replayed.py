"""Where a replayed step's time goes (step_graph.py): a step of T tokens is the C calls its
recording holds, made back to back by one C loop, so no timer in Python sees inside it. Here
each recorded call is made again alone, under a wall-clock timer, and the times are summed per
kernel; the sum is the replay's time give or take the cost of calling from Python (~1 us a
call). Making the calls again is harmless: the step's inputs are still in the graphs' buffers,
so every call computes what it did, and the KV writes write the same values to the same slots.
Used by step_breakdown.py and prefill_breakdown.py."""
from __future__ import annotations

import collections
import time

import torch

from tessera.engine import Engine


def kernel_times(engine: Engine, tokens: int, reps: int = 10) -> tuple[float, list[tuple[str, int, float]]]:
    """For the recorded step of `tokens` tokens: seconds per replay by the C loop, and
    (kernel, calls per step, seconds per step), the largest first; the first of reps + 1 rounds
    warms the caches and is not counted."""
    graphs = engine.runner.graphs
    recording = graphs.graphs[graphs.rows(tokens)].recording     # padded rows: step_graph.py
    recording.replay()
    t = time.perf_counter()
    for _ in range(reps):
        recording.replay()
    loop = (time.perf_counter() - t) / reps
    calls = recording.calls
    seconds: collections.Counter = collections.Counter()
    for r in range(reps + 1):
        for fn, args, _ in calls:
            t = time.perf_counter()
            fn(*args)
            if r:
                seconds[fn.__name__] += time.perf_counter() - t
    count = collections.Counter(fn.__name__ for fn, _, _ in calls)
    return loop, [(name, count[name], s / reps) for name, s in seconds.most_common()]


def linear_weights(engine: Engine) -> tuple[int, int]:
    """The layers' linears' weights: how many, and their bytes."""
    ws = [m.weight for m in engine.runner.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    return sum(w.numel() for w in ws), sum(w.numel() * w.element_size() for w in ws)


def print_replayed(engine: Engine, tokens: int, step_s: float, outside: dict[str, float]) -> list[dict]:
    """Print the replayed step of `tokens` tokens (step_s seconds): the layers' time (the C
    loop's) and their kernels' (the linears' as GFLOP/s and GB/s of weights), then `outside`
    (name: seconds, timed in Python around the replay: the LM head, sampling, ...) and the rest.
    Returns the same as rows {"mode": "replayed", "part", "ms", "share"} for a result file."""
    layers, kernels = kernel_times(engine, tokens)
    calls, alone = sum(c for _, c, _ in kernels), sum(s for _, _, s in kernels)
    linears = sum(s for name, _, s in kernels if "linear" in name or "gemv" in name)
    weights, nbytes = linear_weights(engine)
    print(f"  the layers ({calls} C calls, one C loop): {layers*1e3:.1f} ms ({layers/step_s:.0%}); by kernel, "
          f"each call timed alone ({(alone - layers) / calls * 1e6:.1f} us a call more: calling from Python):")
    print(f"    the linears: {2 * tokens * weights / linears / 1e9:.0f} GFLOP/s, their weights read at "
          f"{nbytes / linears / 1e9:.1f} GB/s")
    for name, count, s in kernels:
        print(f"    {name} x{count}: {s*1e3:.2f} ms ({s/step_s:.0%})")
    for name, s in outside.items():
        print(f"  {name}: {s*1e3:.1f} ms ({s/step_s:.0%})")
    rest = step_s - layers - sum(outside.values())
    print(f"  rest (embedding, scheduler, detokenizer, Python, what is not listed): {rest*1e3:.1f} ms ({rest/step_s:.0%})")
    parts = [("step", step_s), ("the layers (one C loop)", layers), *((f"kernel {n} x{c}", s) for n, c, s in kernels),
             *outside.items(), ("rest", rest)]
    return [{"mode": "replayed", "part": name, "ms": round(s * 1e3, 2), "share": round(s / step_s, 3)}
            for name, s in parts]
