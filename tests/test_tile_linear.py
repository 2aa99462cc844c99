"""The register-tile linears (tessera_kernels.tile_linear, csrc/tile_linear_{bf16,f32}.c): against
the float64 product and oneDNN, bf16 rounding, packing, the same bits on both AVX2 bf16 paths,
which products they take, and the Linear layer's use of them. test_kernels.py's AVX2 rebuild
runs this file too."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera_kernels import amx_linear, tile_linear


def _no_tile_linear(dtype):
    return pytest.mark.skipif(not tile_linear.available(dtype),
                              reason=f"no register-tile linear for {dtype} here (bf16 needs AVX-512 and no AMX)")


# ids: the AVX2 rebuild below selects the float32 ones with -k float32
_TILE_DTYPES = pytest.mark.parametrize("dtype", [
    pytest.param(torch.bfloat16, marks=_no_tile_linear(torch.bfloat16), id="bf16"),
    pytest.param(torch.float32, marks=_no_tile_linear(torch.float32), id="float32")])


@_TILE_DTYPES
@pytest.mark.parametrize("tiles", tile_linear.TILES)
@pytest.mark.parametrize("M", [1, 5, 7, 8, 9, 64, 259, 300])
@pytest.mark.parametrize("N,K,bias", [(960, 576, False), (576, 1536, True), (80, 64, True), (32, 34, True),
                                      (16, 2, False)])
def test_tile_linear_matches_its_reference_and_onednn(dtype, tiles, M, N, K, bias):
    """Row counts on and off the register tiles (every tail of the 8- and 4-row tiles) and past
    one 256-row chunk, full panels, a full one then a narrower one (N = 80 with 16 lanes: 3 + 2
    blocks), narrow ones alone (32, 16), a bias, and x a view whose rows are further apart than K:
    close to the float64 product of the same values (bf16: rounded once), and to oneDNN's linear
    (bf16: but for last-bit differences in a few elements, another split of the sums). bf16 runs
    both of its tiles (vdpbf16ps and FMA), whichever this CPU would pick."""
    if dtype == torch.bfloat16 and M < tile_linear.BF16_MIN_ROWS:
        pytest.skip("the GEMV's rows")
    if dtype == torch.bfloat16 and tiles not in tile_linear.built_tiles():
        pytest.skip("no AVX512-BF16 here: the FMA tiles only")
    if dtype == torch.float32 and tiles != tile_linear.TILES[0]:
        pytest.skip("float32 has one tile")
    g = torch.Generator().manual_seed(M * N + K)
    w = torch.randn(N, K, generator=g).to(dtype)
    x = torch.randn(M, K + 64, generator=g).to(dtype)[:, 32:32 + K]
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    assert tile_linear.applies(x, w)
    y = tile_linear.linear(x, tile_linear.pack(w), b, N, tiles=tiles)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    if dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported():
        onednn = torch.ops.mkldnn._linear_pointwise(x.contiguous(), torch.ops.mkldnn._reorder_linear_weight(w, None),
                                                    b, "none", [], "")
    else:   # oneDNN has no bf16 linear on AVX2-only CPUs: torch's own, what Linear calls there
        onednn = F.linear(x, w, b)
    if dtype == torch.float32:   # float32 sums of K products in another order
        bound = 4 * K * 2.0 ** -24 * F.linear(x.double().abs(), w.double().abs()) + 1e-6
        assert ((y.double() - exact).abs() <= bound).all() and ((onednn.double() - exact).abs() <= bound).all()
        return
    torch.testing.assert_close(y.float(), exact.float(), rtol=1.6e-2, atol=1e-2)
    assert (y != onednn).sum().item() <= max(2, 1e-3 * y.numel())
    # a bf16 step at most, or float32 summation noise where the sum nearly cancels
    one_step = torch.maximum(y.float().abs(), onednn.float().abs()) * 2.0 ** -7 + 1e-3
    assert ((y.float() - onednn.float()).abs() <= one_step).all()


@pytest.mark.skipif(not tile_linear.available(torch.bfloat16), reason="no bf16 register-tile linear here")
@pytest.mark.parametrize("tiles", tile_linear.TILES)
@pytest.mark.parametrize("copies", [1, 2])
def test_tile_linear_bf16_rounds_to_nearest_even_and_keeps_nan_and_infinities(tiles, copies):
    """Each output is x[r, 0] + x[r, 1] (W's two columns are 1), exact in float32, so the bf16
    result must be that sum rounded to nearest, ties to even, as torch rounds it: halfway cases
    both ways, a carry into the exponent, the largest finite value rounding to infinity, NaN
    and infinities (on Cascade Lake and AVX2 the emulated rounding, elsewhere vcvtneps2bf16).
    11 rows, and twice those (22: on AVX2 the unpacked panels' tile)."""
    if tiles not in tile_linear.built_tiles():
        pytest.skip("no AVX512-BF16 here: the FMA tiles only")
    big = torch.finfo(torch.bfloat16).max
    pairs = [(1.0, 2.0 ** -8), (1.0 + 2.0 ** -7, 2.0 ** -8), (-1.0, -(2.0 ** -8)), (1.0, 2.0 ** -9),
             (2.0 - 2.0 ** -7, 2.0 ** -8), (big, big * 2.0 ** -8), (float("inf"), 1.0), (float("-inf"), 1.0),
             (float("nan"), 1.0), (0.0, -0.0), (3.0, 2.0 ** -7)]
    x = torch.tensor(pairs * copies, dtype=torch.bfloat16)
    w = torch.ones(16, 2, dtype=torch.bfloat16)
    y = tile_linear.linear(x, tile_linear.pack(w), None, 16, tiles=tiles)
    expected = (x[:, :1].float() + x[:, 1:].float()).bfloat16().expand(-1, 16)
    assert torch.equal(y.isnan(), expected.isnan())
    assert torch.equal(y[~y.isnan()], expected[~expected.isnan()])


@_TILE_DTYPES
def test_tile_linear_pack_puts_each_weight_where_the_c_source_says(dtype):
    """packed[panel_start + (p * nv + b) * L * pair + pair * j + q] = W[L (3 panel + b) + j][pair p + q]
    (pair: 2 inputs per bf16 dot product, 1 per float32 FMA), the last panel narrower (5 blocks:
    a full panel of 3, then one of 2). Random bit patterns, compared as bits: no two alike."""
    L, pair = tile_linear._library(dtype)[1], tile_linear._pair(dtype)
    N, K = 5 * L, 6
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    w = torch.randperm(N * K, generator=torch.Generator().manual_seed(1)).to(bits).reshape(N, K) + 1000
    packed = tile_linear.pack(w.view(dtype)).view(bits)
    assert packed.numel() == N * K
    for n in range(N):
        for k in range(K):
            panel, b, j, p, q = n // (3 * L), n % (3 * L) // L, n % L, k // pair, k % pair
            nv = 3 if panel == 0 else 2
            assert packed[panel * 3 * L * K + (p * nv + b) * L * pair + pair * j + q] == w[n, k]


@pytest.mark.skipif(not tile_linear.available(torch.bfloat16), reason="no bf16 register-tile linear here")
@pytest.mark.parametrize("M", [16, 45, 300])
@pytest.mark.parametrize("N,K", [(96, 1536), (80, 34), (112, 130)])
def test_tile_linear_bf16_fma_tiles_give_the_same_bits_at_any_row_count(M, N, K):
    """The AVX2 build runs the FMA tiles two ways: pair tiles below 16 rows, panels unpacked to
    float32 (inputs swapped within each pair) from 16 rows on; both must add every output's
    products in the same order. So M rows at once equal the same rows 8 at a time, bit for bit
    (a swap left out changes last bits; on AVX-512 builds both calls run one tile). 300 rows:
    a 256-row chunk on the panels, then 44; N 80 and 112: a narrower last panel (of 1 and 2
    blocks of 8 lanes), K 34 and 130: x's conversion ends off a whole vector."""
    g = torch.Generator().manual_seed(M * N + K)
    x = torch.randn(M, K, generator=g).bfloat16()
    w = torch.randn(N, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16()
    packed = tile_linear.pack(w)
    whole = tile_linear.linear(x, packed, b, N, tiles="fma")
    rows = [tile_linear.linear(x[i:i + 8], packed, b, N, tiles="fma") if M - i >= tile_linear.BF16_MIN_ROWS
            else tile_linear.linear(x[i - 8:i + 8], packed, b, N, tiles="fma")[8:] for i in range(0, M, 8)]
    assert torch.equal(whole, torch.cat(rows))


def test_tile_linear_applies_to_bf16_from_five_rows_and_float32_from_one():
    w = torch.zeros(48, 64, dtype=torch.bfloat16)
    ok = tile_linear.available(torch.bfloat16)
    assert tile_linear.applies(torch.zeros(5, 64, dtype=torch.bfloat16), w) == ok
    assert tile_linear.applies(torch.zeros(2048, 64, dtype=torch.bfloat16), w) == ok
    assert not tile_linear.applies(torch.zeros(4, 64, dtype=torch.bfloat16), w)        # the GEMV's
    assert tile_linear.applies(torch.zeros(1, 64), w.float()) == tile_linear.available(torch.float32)
    assert not tile_linear.applies(torch.zeros(8, 64), w)                               # mixed dtypes
    assert not tile_linear.applies(torch.zeros(8, 63, dtype=torch.bfloat16), torch.zeros(48, 63, dtype=torch.bfloat16))
    assert not tile_linear.applies(torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(44, 64, dtype=torch.bfloat16))
    assert not tile_linear.applies(torch.zeros(1, 64, dtype=torch.bfloat16).expand(8, 64), w)   # rows overlap
    assert not tile_linear.applies(torch.zeros(8, 64, dtype=torch.float16), w.half())
    assert not tile_linear.applies(torch.zeros(8, 128, dtype=torch.bfloat16), w)          # x wider than W
    assert not tile_linear.applies(torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(0, 64, dtype=torch.bfloat16))
    assert not (tile_linear.available(torch.bfloat16) and amx_linear.available())   # one packed bf16 kernel per CPU


@_TILE_DTYPES
def test_linear_layer_takes_the_register_tile_path(dtype, monkeypatch):
    """The layer sends bf16 products of 5+ rows (1-4: the GEMV) and float32 products of any size
    to the kernel (spied), and packs again after its weight is edited in place."""
    from tessera.layers.linear import Linear
    layer = Linear(64, 96, bias=True).to(dtype).requires_grad_(False)
    calls = []
    real = tile_linear.linear
    monkeypatch.setattr(tile_linear, "linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    with torch.inference_mode():
        x = torch.randn(12, 64).to(dtype)
        y = layer(x)
        layer(x[:3])
        assert calls == ([12] if dtype == torch.bfloat16 else [12, 3])
        torch.testing.assert_close(y.float(), F.linear(x.float(), layer.weight.float(), layer.bias.float()),
                                   rtol=1.6e-2, atol=1e-2)
        layer.weight.mul_(2)
        assert torch.equal(layer(x), real(x, tile_linear.pack(layer.weight), layer.bias, 96))
