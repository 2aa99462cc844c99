"""The engine's steps when 64 prompts arrive at once (no HTTP): each step's wall time, the
prefill steps (2048 tokens each, `max_num_batched_tokens`) first, then decode. Prompt lengths
are drawn from 128 * (1 +- RANGE_RATIO) as `tessera bench serve --range-ratio` draws them;
random tokens, greedy, 128 output tokens each, after one pass that warms the engine up.
    .venv/bin/python bench/prefill_steps.py [RANGE_RATIO] [float32] [--out FILE]   # 0: every prompt 128 tokens; bf16
"""
import sys
import time

import torch

from tessera.config import EngineConfig, SamplingParams
from tessera.engine import Engine

from result_file import pop_out, save   # bench/, the script's own folder, is on sys.path

OUT = pop_out()
RANGE_RATIO = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
DTYPE = sys.argv[2] if len(sys.argv) > 2 else "bfloat16"
engine = Engine(EngineConfig(dtype=DTYPE, num_threads=2))


def one_pass(seed: int) -> tuple[float, list[float]]:
    g = torch.Generator().manual_seed(seed)
    for _ in range(64):
        n = round(128 * (1 + RANGE_RATIO * (2 * torch.rand(1, generator=g).item() - 1)))
        engine.add_request(torch.randint(100, 40000, (n,), generator=g).tolist(),
                           SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
    steps, start = [], time.perf_counter()
    while engine.has_unfinished:
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    return time.perf_counter() - start, steps


one_pass(1)
wall, steps = one_pass(2)   # other prompts: the first pass's would be prefix-cache hits
decode = sorted(steps[8:])
print(f"range ratio {RANGE_RATIO}, {DTYPE}: {wall:.2f} s, {len(steps)} steps; the first 6 (ms): "
      f"{[round(s * 1e3) for s in steps[:6]]}; decode steps after them, median {decode[len(decode) // 2] * 1e3:.1f} ms")
save(OUT, "prefill", "engine steps when 64 prompts of ~128 tokens arrive at once (no HTTP)",
     [{"range_ratio": RANGE_RATIO, "dtype": DTYPE, "prompts": 64, "output_len": 128, "wall_s": round(wall, 2),
       "steps": len(steps), "first_steps_ms": [round(s * 1e3) for s in steps[:6]],
       "decode_step_p50_ms": round(decode[len(decode) // 2] * 1e3, 1)}])
