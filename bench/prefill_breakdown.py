"""Where a prompt step's time goes (the TTFT of one request: one prompt alone in its step):
the engine's pieces wrapped in wall-clock timers (on the CPU nothing runs asynchronously, so a
timer around a call is its cost), median of 15 steps, each a fresh prompt of LEN tokens.
    .venv/bin/python bench/prefill_breakdown.py [LEN] [float32]   # 128 tokens, bfloat16 by default
"""
import collections
import statistics
import sys
import time

import torch

import tessera.engine as E
import tessera.layers.attention as A
import tessera.layers.linear as L
import tessera.layers.mlp as MLP
import tessera.layers.norm as N
import tessera.model_runner as MR
import tessera.models.driver as D
import tessera.models.llama as LL
from tessera.config import EngineConfig, SamplingParams
from tessera.engine import Engine

acc: collections.Counter = collections.Counter()


def timed(name, f):
    def g(*a, **k):
        t = time.perf_counter()
        r = f(*a, **k)
        acc[name] += time.perf_counter() - t
        return r
    return g


L.Linear.forward = timed("linears", L.Linear.forward)
LL.paged_attention = timed("attention (KV write + SDPA)", A.paged_attention)
N.RMSNorm.forward = timed("RMSNorm", N.RMSNorm.forward)
MLP.silu_mul = timed("SwiGLU activation", MLP.silu_mul)
LL.apply_rope = timed("RoPE", LL.apply_rope)
D.residual_add = timed("residual adds", D.residual_add)
LL.residual_add = timed("residual adds", LL.residual_add)
E.sample = timed("sampling", E.sample)
MR.build_forward_batch = timed("batch tensors", MR.build_forward_batch)

LEN = int(sys.argv[1]) if len(sys.argv) > 1 else 128
DTYPE = sys.argv[2] if len(sys.argv) > 2 else "bfloat16"
e = Engine(EngineConfig(dtype=DTYPE, num_threads=2))
g = torch.Generator().manual_seed(LEN)
steps, parts = [], collections.defaultdict(list)
for i in range(18):
    e.add_request(torch.randint(100, 40000, (LEN,), generator=g).tolist(),
                  SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    acc.clear()
    t = time.perf_counter()
    e.step()
    if i >= 3:                            # the first steps warm the caches and packed weights
        steps.append(time.perf_counter() - t)
        for k, v in acc.items():
            parts[k].append(v)
    while e.has_unfinished:
        e.step()
total = statistics.median(steps)
print(f"{LEN}-token prompt, {DTYPE}: step {total*1e3:.1f} ms median "
      f"({min(steps)*1e3:.1f}-{max(steps)*1e3:.1f})")
named = 0.0
for k, v in sorted(parts.items(), key=lambda kv: -statistics.median(kv[1])):
    m = statistics.median(v)
    named += m
    print(f"  {k}: {m*1e3:.1f} ms ({m/total:.0%})")
print(f"  rest (embedding, scheduler, Python between the calls): {(total-named)*1e3:.1f} ms ({(total-named)/total:.0%})")
