"""Where a prompt step's time goes (the TTFT of one request: one prompt alone in its step):
the engine's pieces wrapped in wall-clock timers (on the CPU nothing runs asynchronously, so a
timer around a call is its cost), median of 15 steps, each a fresh prompt of LEN tokens. The
timers need the eager step (--enforce-eager); the replayed step (step_graph.py; prompts of up to
its MAX_TOKENS) is timed after it, on another engine: as a whole, and its layers' C calls by
kernel (replayed.py).
    .venv/bin/python bench/prefill_breakdown.py [LEN] [float32] [--out FILE]   # 128 tokens, bfloat16 by default
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
from tessera.step_graph import MAX_TOKENS

from replayed import print_replayed   # bench/, the script's own folder, is on sys.path
from result_file import pop_out, save

acc: collections.Counter = collections.Counter()


def timed(name, f):
    def g(*a, **k):
        t = time.perf_counter()
        r = f(*a, **k)
        acc[name] += time.perf_counter() - t
        return r
    return g


L.Linear.forward = timed("linears", L.Linear.forward)
LL.paged_attention = timed("attention (KV write + paged kernel or SDPA)", A.paged_attention)
N.RMSNorm.forward = timed("RMSNorm", N.RMSNorm.forward)
MLP.silu_mul = timed("SwiGLU activation", MLP.silu_mul)
LL.apply_rope = timed("RoPE", LL.apply_rope)
D.residual_add = timed("residual adds", D.residual_add)
LL.residual_add = timed("residual adds", LL.residual_add)
E.sample = timed("sampling", E.sample)
MR.build_forward_batch = timed("batch tensors", MR.build_forward_batch)

OUT = pop_out()
LEN = int(sys.argv[1]) if len(sys.argv) > 1 else 128
DTYPE = sys.argv[2] if len(sys.argv) > 2 else "bfloat16"


def prompt_steps(enforce_eager: bool) -> tuple[float, dict, Engine]:
    """Median, fastest and slowest step, median time per timer, and the engine."""
    e = Engine(EngineConfig(dtype=DTYPE, num_threads=2, enforce_eager=enforce_eager))
    g = torch.Generator().manual_seed(LEN)
    steps, parts = [], collections.defaultdict(list)
    for i in range(18):
        e.add_request(torch.randint(100, 40000, (LEN,), generator=g).tolist(),
                      SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        acc.clear()
        t = time.perf_counter()
        e.step()
        if i >= 3:                        # the first steps warm the caches and packed weights
            steps.append(time.perf_counter() - t)
            for k, v in acc.items():
                parts[k].append(v)
        while e.has_unfinished:
            e.step()
    return (statistics.median(steps), min(steps), max(steps)), {k: statistics.median(v) for k, v in parts.items()}, e


(total, fastest, slowest), parts, _ = prompt_steps(True)
print(f"{LEN}-token prompt, {DTYPE}: step {total*1e3:.1f} ms median ({fastest*1e3:.1f}-{slowest*1e3:.1f}), eager")
for k, m in sorted(parts.items(), key=lambda kv: -kv[1]):
    print(f"  {k}: {m*1e3:.1f} ms ({m/total:.0%})")
rest = total - sum(parts.values())
print(f"  rest (embedding, scheduler, Python between the calls): {rest*1e3:.1f} ms ({rest/total:.0%})")
rows = [{"mode": "eager", "part": k, "ms": round(m * 1e3, 2), "share": round(m / total, 3)}
        for k, m in [("step", total), *sorted(parts.items(), key=lambda kv: -kv[1]), ("rest", rest)]]
TITLE = f"where a {LEN}-token prompt step's time goes, {DTYPE}"
if LEN > MAX_TOKENS:
    save(OUT, "prefill", TITLE, [{**r, "tokens": LEN, "dtype": DTYPE} for r in rows])
    sys.exit(f"(no replayed step: prompts over step_graph.MAX_TOKENS = {MAX_TOKENS} tokens run eagerly)")
(replayed, fastest, slowest), parts, e = prompt_steps(False)
print(f"replayed (step_graph.py): step {replayed*1e3:.1f} ms median ({fastest*1e3:.1f}-{slowest*1e3:.1f})")
# after the replay, from Python: the final norm and the LM head of the last token
outside = {{"linears": "LM head", "RMSNorm": "final norm"}.get(k, k): v for k, v in parts.items()}
rows += print_replayed(e, LEN, replayed, outside)
save(OUT, "prefill", TITLE, [{**r, "tokens": LEN, "dtype": DTYPE} for r in rows])
