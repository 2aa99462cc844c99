"""The paged attention kernel (csrc/paged_decode_attention.c) against its torch reference: decode
rows, prompt chunks' rows (the tiles), float32 and bf16 caches (tolerance from the reference's
own rounding). Also run in the AVX2 rebuild of test_kernels.py."""
from __future__ import annotations

import pytest
import torch

from tessera_kernels import paged_attention_cpu as pa, tile_linear

pytestmark = pytest.mark.kernels


@pytest.mark.skipif(not pa.available(), reason="no C compiler for the CPU kernel")
@pytest.mark.parametrize("H,KV,D,bs", [(9, 3, 64, 16), (4, 4, 32, 4), (8, 1, 16, 8), (6, 2, 128, 2)])
def test_paged_decode_attention_matches_reference(H, KV, D, bs):
    g = torch.Generator().manual_seed(H * 100 + D)
    num_blocks, B = 48, 5
    k_cache = torch.randn(KV, num_blocks * bs, D, generator=g)
    v_cache = torch.randn(KV, num_blocks * bs, D, generator=g)
    lens = torch.tensor([1, bs, bs + 1, 3 * bs - 1, 5 * bs])
    width = int(-(-lens.max() // bs))
    tables = torch.randperm(num_blocks, generator=g)[:B * width].view(B, width)
    q = torch.randn(B, H, D, generator=g)
    out = pa.paged_decode_attention(q, k_cache, v_cache, tables, lens, bs, D ** -0.5)
    ref64 = pa.paged_decode_attention_ref(q.double(), k_cache.double(), v_cache.double(), tables, lens, bs, D ** -0.5)
    ref32 = pa.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, bs, D ** -0.5)
    torch_err = (ref32.double() - ref64).abs().max()
    assert (out.double() - ref64).abs().max() <= 2 * torch_err + 1e-6


@pytest.mark.skipif(not pa.available(), reason="no C compiler for the CPU kernel")
@pytest.mark.parametrize("H,KV,D,bs", [(9, 3, 64, 16), (8, 1, 16, 8), (6, 2, 128, 2)])
def test_paged_decode_attention_bf16_cache(H, KV, D, bs):
    """bf16 cache and query, float32 arithmetic: equal to the float64 reference on the same
    bf16 values up to the final rounding of the result to bf16 (and a float32 sum's error).
    Where the kernel rounds the probabilities to bf16 (AVX512-BF16), the reference does too;
    its float32 exponentials may round a few of them the other way, each an error of at most
    one bf16 ulp (2^-7 relative) of one term: two are allowed."""
    g = torch.Generator().manual_seed(H * 100 + D + 1)
    num_blocks, B = 48, 5
    k_cache = torch.randn(KV, num_blocks * bs, D, generator=g).bfloat16()
    v_cache = torch.randn(KV, num_blocks * bs, D, generator=g).bfloat16()
    lens = torch.tensor([1, bs, bs + 1, 3 * bs - 1, 5 * bs])
    width = int(-(-lens.max() // bs))
    tables = torch.randperm(num_blocks, generator=g)[:B * width].view(B, width)
    q = torch.randn(B, H, D, generator=g).bfloat16()
    out = pa.paged_decode_attention(q, k_cache, v_cache, tables, lens, bs, D ** -0.5)
    assert out.dtype == torch.bfloat16
    rounded = pa.probabilities_in_bf16(D)
    ref64 = pa.paged_decode_attention_ref(q.double(), k_cache.double(), v_cache.double(), tables, lens, bs,
                                          D ** -0.5, bf16_probs=rounded)
    bf16_rounding = ref64.abs() * 2.0 ** -8       # half an ulp of bf16's 8-bit mantissa
    flips = 2 * 2.0 ** -7 * _largest_term(q, k_cache, v_cache, tables, lens, bs) if rounded else 0
    assert ((out.double() - ref64).abs() <= bf16_rounding + flips + 1e-5).all()


@pytest.mark.skipif(not pa.available(), reason="no C compiler for the CPU kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_paged_decode_attention_reads_q_in_place(dtype):
    """q as the model passes it, a view of the fused QKV output (tokens (H + 2 KV) * D apart):
    the same bits as from a contiguous copy."""
    g = torch.Generator().manual_seed(7)
    H, KV, D, bs, B = 9, 3, 64, 16, 6
    k_cache = torch.randn(KV, 32 * bs, D, generator=g).to(dtype)
    v_cache = torch.randn(KV, 32 * bs, D, generator=g).to(dtype)
    lens = torch.tensor([1, 5, 16, 17, 40, 70])
    tables = torch.randperm(32, generator=g)[:B * 5].view(B, 5)
    q = torch.randn(B, H + 2 * KV, D, generator=g).to(dtype)[:, :H]
    assert not q.is_contiguous()
    out = pa.paged_decode_attention(q, k_cache, v_cache, tables, lens, bs, D ** -0.5)
    assert torch.equal(out, pa.paged_decode_attention(q.contiguous(), k_cache, v_cache, tables, lens, bs, D ** -0.5))


@pytest.mark.skipif(not pa.available(), reason="no C compiler for the CPU kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("H,KV,D", [(9, 3, 64), (6, 2, 128), (4, 4, 32)])
def test_paged_decode_attention_prompt_chunk_rows(dtype, H, KV, D):
    """Rows as a step passes them: prompt chunks (each token a row whose context ends at
    itself: 37 rows from position 0, 10 after 20 cached tokens, 3 from position 0) between
    decode rows, q a view of the fused QKV output. Runs of a chunk's rows go in tiles of up to
    16 (bf16 dot products on AVX512-BF16, float32 FMAs otherwise): the 37 rows are tiles of 16, 16 and 5, the 10 rows one tile
    (the decode row of length 20 before them is another request's: not in it), the 3 rows stay
    rows. The result is the reference's as for single rows. (4, 4, 32) takes the tile code
    without constant shapes."""
    g = torch.Generator().manual_seed(H * 10 + D)
    bs, num_blocks = 8, 64
    k_cache = torch.randn(KV, num_blocks * bs, D, generator=g).to(dtype)
    v_cache = torch.randn(KV, num_blocks * bs, D, generator=g).to(dtype)
    blocks = torch.randperm(num_blocks, generator=g)
    request_tables = [blocks[0:6], blocks[6:10], blocks[10:11], blocks[11:16], blocks[16:20]]
    rows = [(1, 25), (0, None), (2, None), (3, 20), (4, None)]   # (request, decode context or None: its chunk)
    chunks = {0: (0, 37), 2: (0, 3), 4: (20, 10)}                # request: (start position, tokens)
    lens, tables = [], []
    for req, ctx in rows:
        span = [ctx] if ctx is not None else range(chunks[req][0] + 1, sum(chunks[req]) + 1)
        for length in span:
            lens.append(length)
            tables.append(torch.nn.functional.pad(request_tables[req], (0, 6 - len(request_tables[req]))))
    lens, tables = torch.tensor(lens), torch.stack(tables)
    q = torch.randn(len(lens), H + 2 * KV, D, generator=g).to(dtype)[:, :H]
    out = pa.paged_decode_attention(q, k_cache, v_cache, tables, lens, bs, D ** -0.5)
    rounded = dtype == torch.bfloat16 and pa.probabilities_in_bf16(D)
    assert pa.tiles_planned(tables, lens, bs, D, dtype) == 4
    ref64 = pa.paged_decode_attention_ref(q.double(), k_cache.double(), v_cache.double(), tables, lens, bs,
                                          D ** -0.5, bf16_probs=rounded)
    if dtype == torch.float32:
        ref32 = pa.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, bs, D ** -0.5)
        assert (out.double() - ref64).abs().max() <= 2 * (ref32.double() - ref64).abs().max() + 1e-6
    else:
        flips = 2 * 2.0 ** -7 * _largest_term(q, k_cache, v_cache, tables, lens, bs) if rounded else 0
        assert ((out.double() - ref64).abs() <= ref64.abs() * 2.0 ** -8 + flips + 1e-5).all()


def _largest_term(q, k_cache, v_cache, tables, lens, bs):
    """[B, H, D]: the largest |p_t v_t| / sum(p) of each output, the most one probability's
    rounding can move it by (per ulp)."""
    q, k_cache, v_cache = q.double(), k_cache.double(), v_cache.double()
    B, H, D = q.shape
    G = H // k_cache.shape[0]
    out = torch.empty(B, H, D, dtype=torch.float64)
    for b in range(B):
        t = torch.arange(int(lens[b]))
        slots = tables[b, t // bs] * bs + t % bs
        k = k_cache[:, slots].repeat_interleave(G, dim=0)          # [H, L, D]
        v = v_cache[:, slots].repeat_interleave(G, dim=0)
        p = torch.softmax((k @ q[b].unsqueeze(-1)).squeeze(-1) * D ** -0.5, dim=-1)   # [H, L]
        out[b] = (p.unsqueeze(-1) * v.abs()).amax(1)
    return out


@pytest.mark.skipif(not pa.available() or tile_linear.built_tiles() != tile_linear.TILES,
                    reason="no AVX512-BF16 here: one build of the kernel")
def test_both_builds_for_avx512_bf16_pass_the_same_tests(tmp_path):
    """Where the CPU has AVX512-BF16 the kernel is built with its bf16 dot products, or without
    them where the FMA tiles were faster (tile_linear.bf16_tiles: Intel without AMX). This CPU's
    other build, in its own cache, passes every test of this file, and it is the build asked for:
    the dot-product one rounds the probabilities to bf16, the other does not."""
    import os
    import subprocess
    import sys
    other = "dot" if tile_linear.bf16_tiles() == "fma" else "fma"
    env = {**os.environ, "TESSERA_BF16_TILES": other, "TESSERA_CACHE": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "not both_builds"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "passed" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    probe = subprocess.run([sys.executable, "-c", "from tessera_kernels import paged_attention_cpu as pa; "
                            "print(pa.probabilities_in_bf16(64))"], env=env, capture_output=True, text=True, timeout=300)
    assert probe.stdout.strip() == str(other == "dot")
    assert pa.probabilities_in_bf16(64) == (other == "fma")
