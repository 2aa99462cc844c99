"""Decode attention over a bf16 KV cache against an int8 one (--kv-cache-dtype int8): one layer
of SmolLM2's shape (9 query heads, 3 KV heads, 64 wide), BATCH requests of CONTEXT tokens each,
16-token blocks at random places; each call's milliseconds, bf16 and int8 calls alternating,
the median of ROUNDS rounds each, and their ratio. Writes
bench/results/kernel-<cpu kind>-<date>-kv-int8.json unless --out names another file.
    .venv/bin/python bench/kv_int8.py [BATCH] [CONTEXT] [ROUNDS] [--out FILE]   # 64, 1024, 15
"""
import datetime
import statistics
import sys
import time

import torch

from tessera.cpu_kind import describe_cpu
from tessera_kernels import kv_int8, paged_attention_cpu

from result_file import pop_out, save   # bench/, the script's own folder, is on sys.path

OUT = pop_out()
BATCH = int(sys.argv[1]) if len(sys.argv) > 1 else 64
CONTEXT = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 15
H, KV, D, BLOCK = 9, 3, 64, 16

g = torch.Generator().manual_seed(0)
blocks = BATCH * CONTEXT // BLOCK
tables = torch.randperm(blocks, generator=g).view(BATCH, -1)
lens = torch.full((BATCH,), CONTEXT)
k = torch.randn(KV, blocks * BLOCK, D, generator=g).bfloat16()
v = torch.randn(KV, blocks * BLOCK, D, generator=g).bfloat16()
k8, v8 = kv_int8.quantize_ref(k), kv_int8.quantize_ref(v)
q = torch.randn(BATCH, H, D, generator=g).bfloat16()
calls = {"bf16": lambda: paged_attention_cpu.paged_decode_attention(q, k, v, tables, lens, BLOCK, D ** -0.5),
         "int8": lambda: kv_int8.paged_decode_attention_int8(q, k8, v8, tables, lens, BLOCK, D ** -0.5)}
times = {name: [] for name in calls}
for name, call in calls.items():
    call()   # builds the kernel, touches the caches
for _ in range(ROUNDS):
    for name, call in calls.items():
        t0 = time.perf_counter()
        call()
        times[name].append((time.perf_counter() - t0) * 1e3)
ms = {name: statistics.median(t) for name, t in times.items()}
ratio = ms["bf16"] / ms["int8"]
print(f"batch {BATCH}, context {CONTEXT}, {torch.get_num_threads()} threads: bf16 {ms['bf16']:.2f} ms, "
      f"int8 {ms['int8']:.2f} ms, bf16 / int8 = {ratio:.2f}")
kind = describe_cpu()["kind"]
out = OUT or f"bench/results/kernel-{kind}-{datetime.date.today().isoformat()}-kv-int8.json"
rows = [{"cache": name, "batch": BATCH, "context": CONTEXT, "threads": torch.get_num_threads(),
         "ms": round(ms[name], 3), "speedup_vs_bf16": round(ms["bf16"] / ms[name], 3)} for name in calls]
save(out, "kernel", "Decode attention, bf16 vs int8 KV cache (SmolLM2 layer shape)", rows,
     notes=f"median of {ROUNDS} alternating calls each; one layer, {H} query / {KV} KV heads of {D}, blocks of {BLOCK}")
