"""bf16 against float32 in one process: two engines (replayed steps, as served), interleaved, so
the machine's drift falls on both alike. Decode steps at each batch size (prompts of 128 tokens,
contexts ~150-200), then a 128-token prompt step (a one-stream TTFT without HTTP); median and
best per dtype. Measures what --dtype auto should pick on this CPU (engine.resolve_dtype).
    .venv/bin/python bench/dtype_ab.py [batch ...] [--out FILE]   # 1 64 unless given; 2 threads
"""
import statistics
import sys
import time

import torch

from tessera.config import EngineConfig, SamplingParams
from tessera.engine import Engine

from result_file import pop_out, save   # bench/, the script's own folder, is on sys.path

DTYPES = ("bfloat16", "float32")
OUT = pop_out()
ROWS: list[dict] = []


def report(what: str, times: dict[str, list[float]], batch: int) -> None:
    print(what + ": " + ", ".join(f"{d} {statistics.median(v) * 1e3:.1f} ms (best {min(v) * 1e3:.1f})"
                                  for d, v in times.items()))
    ROWS.extend({"step": what, "batch": batch, "dtype": d, "median_ms": round(statistics.median(v) * 1e3, 2),
                 "best_ms": round(min(v) * 1e3, 2)} for d, v in times.items())


def decode(B: int) -> None:
    engines = {d: Engine(EngineConfig(dtype=d, num_threads=2)) for d in DTYPES}
    prompts = torch.randint(100, 40000, (B, 128), generator=torch.Generator().manual_seed(B)).tolist()
    for e in engines.values():
        for p in prompts:
            e.add_request(p, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        while e.scheduler.waiting or any(r.num_computed_tokens < 128 for r in e.scheduler.running):
            e.step()
        for _ in range(20):           # the decode graphs recorded
            e.step()
    times = {d: [] for d in DTYPES}
    for _ in range(6):
        for d, e in engines.items():
            t = time.perf_counter()
            for _ in range(8):
                e.step()
            times[d].append((time.perf_counter() - t) / 8)
    report(f"decode step at batch {B}", times, B)


def prompt_step(n: int = 128) -> None:
    engines = {d: Engine(EngineConfig(dtype=d, num_threads=2)) for d in DTYPES}
    g, times = torch.Generator().manual_seed(n), {d: [] for d in DTYPES}
    for i in range(14):
        p = torch.randint(100, 40000, (n,), generator=g).tolist()
        for d, e in engines.items():
            e.add_request(p, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            t = time.perf_counter()
            e.step()
            if i >= 3:                # the first steps record the graph and pack the weights
                times[d].append(time.perf_counter() - t)
            while e.has_unfinished:
                e.step()
    report(f"{n}-token prompt step", times, 1)


for batch in [int(a) for a in sys.argv[1:]] or [1, 64]:
    decode(batch)
prompt_step()
save(OUT, "dtype", "bfloat16 against float32: decode and prompt steps of the replayed engine", ROWS)
