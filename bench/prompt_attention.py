"""The paged attention kernel on one prompt's rows alone (each row attends to the tokens up to
itself, as in a prompt step), SmolLM2's heads (9 query, 3 KV, 64 wide), a bf16 cache in 16-token
blocks at random places: milliseconds per layer, and GFLOP/s of the causal products (QK and PV);
then torch's SDPA on the same prompt (causal, its own K/V, as layers/attention.py calls it for a
fresh prompt), the two interleaved, best of five rounds each.
    .venv/bin/python bench/prompt_attention.py [LEN] [CALLS] [float32] [--out FILE]   # 1024 tokens, 50 calls, bf16
"""
import sys
import time

import torch
import torch.nn.functional as F

from tessera_kernels import paged_attention_cpu

from result_file import pop_out, save   # bench/, the script's own folder, is on sys.path

OUT = pop_out()
LEN = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
CALLS = int(sys.argv[2]) if len(sys.argv) > 2 else 50
DTYPE = getattr(torch, sys.argv[3]) if len(sys.argv) > 3 else torch.bfloat16
H, KV, D, BLOCK, SLOTS = 9, 3, 64, 16, 8192

torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
k_cache = torch.randn(KV, SLOTS, D, generator=g).to(DTYPE)
v_cache = torch.randn(KV, SLOTS, D, generator=g).to(DTYPE)
blocks = torch.randperm(SLOTS // BLOCK, generator=g)[:(LEN + BLOCK - 1) // BLOCK]
tables, lens = blocks.repeat(LEN, 1), torch.arange(1, LEN + 1)
q = torch.randn(LEN, H, D, generator=g).to(DTYPE)
k, v = (torch.randn(LEN, KV, D, generator=g).to(DTYPE) for _ in range(2))


def kernel() -> None:
    paged_attention_cpu.paged_decode_attention(q, k_cache, v_cache, tables, lens, BLOCK, D ** -0.5)


def sdpa() -> None:
    F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                   is_causal=True, scale=D ** -0.5, enable_gqa=True)


best = {kernel: float("inf"), sdpa: float("inf")}
for f in best:
    f()
for _ in range(5):
    for f in best:
        t = time.perf_counter()
        for _ in range(CALLS):
            f()
        best[f] = min(best[f], (time.perf_counter() - t) / CALLS)
flops = LEN * (LEN + 1) / 2 * H * D * 2 * 2
for f, name in ((kernel, "kernel"), (sdpa, "SDPA")):
    print(f"{LEN}-token prompt, {str(DTYPE).removeprefix('torch.')}, {name}: {best[f] * 1e3:.2f} ms a layer, "
          f"{flops / best[f] / 1e9:.0f} GFLOP/s of causal products")
save(OUT, "kernel", "paged attention over one prompt's rows against torch's SDPA, one layer of SmolLM2",
     [{"kernel": "paged attention (prompt rows)", "shape": f"{LEN} tokens, {H} query / {KV} KV heads x {D}",
       "dtype": str(DTYPE).removeprefix("torch."), "tessera_us": round(best[kernel] * 1e6, 1), "reference": "SDPA",
       "reference_us": round(best[sdpa] * 1e6, 1), "tessera_gflops": round(flops / best[kernel] / 1e9)}])
