"""Kernels against their torch references (tolerance from the reference's own rounding)."""
from __future__ import annotations

import pytest
import torch

from tessera_kernels import paged_attention_cpu as pa

pytestmark = pytest.mark.kernels


@pytest.mark.skipif(not pa.available(), reason="no C compiler for the CPU kernel")
@pytest.mark.parametrize("H,KV,D,bs", [(9, 3, 64, 16), (4, 4, 32, 4), (8, 1, 16, 8), (6, 2, 20, 2)])
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
