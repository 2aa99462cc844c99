"""Where a decode step's time goes, at a batch size: the engine's pieces wrapped in wall-clock
timers (on the CPU nothing runs asynchronously, so a timer around a call is its cost). The
timers need the eager step (--enforce-eager); the replayed step (step_graph.py) is timed
after it, on another engine: as a whole, its layers' C calls by kernel (replayed.py), and the
LM head, sampling and batch tensors, which run from Python after the replay.
    .venv/bin/python bench/step_breakdown.py 64 [float32] [--model DIR] [--out FILE]
bf16 unless given; 2 threads, context ~190; SmolLM2 unless --model (e.g. `tessera bench make-llama1b`'s).
"""
import sys, time, collections, torch
from tessera.config import EngineConfig, SamplingParams
from tessera.engine import Engine
import tessera.layers.linear as L, tessera.layers.attention as A, tessera.models.llama as LL, tessera.engine as E
import tessera.models.driver as D, tessera.batch as BT, tessera.model_runner as MR
from replayed import print_replayed   # bench/, the script's own folder, is on sys.path
from result_file import pop_out, save
acc = collections.Counter()
def timed(name, f):
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc[name] += time.perf_counter() - t; return r
    return g
L.Linear.forward = timed("linears (qkv, o, gate_up, down, lm_head)", L.Linear.forward)
LL.paged_attention = timed("attention (KV write + paged decode kernel)", A.paged_attention)
E.sample = timed("sampling", E.sample)
import tessera_kernels.paged_attention_cpu as PA
PA.paged_decode_attention = timed("  of which the decode kernel itself", PA.paged_decode_attention)
MR.build_forward_batch = timed("batch tensors (build_forward_batch)", MR.build_forward_batch)
OUT = pop_out()
MODEL = {}
if "--model" in sys.argv:
    i = sys.argv.index("--model")
    MODEL["model"] = sys.argv.pop(i + 1)
    sys.argv.pop(i)
B = int(sys.argv[1])
DTYPE = sys.argv[2] if len(sys.argv) > 2 else "bfloat16"
n = 20                                # steps timed


def step_s(enforce_eager: bool) -> tuple[float, Engine]:
    e = Engine(EngineConfig(dtype=DTYPE, num_threads=2, enforce_eager=enforce_eager, **MODEL))
    g = torch.Generator().manual_seed(B)
    for p in torch.randint(100, 40000, (B, 128), generator=g).tolist():
        e.add_request(p, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    while e.scheduler.waiting or any(r.num_computed_tokens < 128 for r in e.scheduler.running): e.step()
    for _ in range(64): e.step()      # contexts ~ 128 + 64: the middle of a 128/128 run
    acc.clear(); t = time.perf_counter()
    for _ in range(n): e.step()
    return (time.perf_counter() - t) / n, e


total, _ = step_s(True)
print(f"batch {B}, {DTYPE}: decode step {total*1e3:.1f} ms eager")
for k, v in acc.most_common():
    print(f"  {k}: {v/n*1e3:.1f} ms ({v/n/total:.0%})")
rest = total - sum(v for k, v in acc.items() if not k.startswith(" ")) / n
print(f"  rest (norms, RoPE, residuals, SwiGLU activation, scheduler, detokenizer, Python): {rest*1e3:.1f} ms ({rest/total:.0%})")
rows = [{"mode": "eager", "part": k.strip(), "ms": round(s * 1e3, 2), "share": round(s / total, 3)}
        for k, s in [("step", total), *((k, v / n) for k, v in acc.most_common()), ("rest", rest)]]
TITLE = f"where a decode step's time goes at batch {B}, {DTYPE}" + (f", model {MODEL['model']}" if MODEL else "")
replayed, e = step_s(False)
print(f"replayed (step_graph.py): decode step {replayed*1e3:.1f} ms")
if e.runner.graphs.rows(B) not in e.runner.graphs.graphs:
    save(OUT, "step", TITLE, [{**r, "batch": B, "dtype": DTYPE} for r in rows])
    sys.exit(f"(no graph of {B} rows was kept: see the engine's log)")
outside = {"LM head" if k.startswith("linears") else k: v / n for k, v in acc.items()}   # after the replay
rows += print_replayed(e, B, replayed, outside)
save(OUT, "step", TITLE, [{**r, "batch": B, "dtype": DTYPE} for r in rows])
