"""Kernels against their torch references (tolerance from the reference's own rounding)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.layers.norm import rms_norm_low_precision
from tessera_kernels import amx_linear, cbuild, elementwise_cpu, gemv_cpu, gemv_quant_cpu
from tessera_kernels import paged_attention_cpu as pa

pytestmark = pytest.mark.kernels


@pytest.mark.skipif(gemv_cpu._library() is None, reason="no C compiler for the CPU kernel")
@pytest.mark.parametrize("M,N,K,bias", [(1, 960, 576, False), (2, 77, 32, True), (3, 576, 1536, False),
                                        (4, 19, 16, True)])
def test_gemv_bf16_matches_reference(M, N, K, bias):
    """Float32 sums of the same bf16 products in another order, rounded to bf16 once: within
    one bf16 rounding of the float64 product (plus the float32 sum's own error)."""
    g = torch.Generator().manual_seed(M * 1000 + N)
    x = torch.randn(M, K, generator=g).bfloat16()
    w = torch.randn(N, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16() if bias else None
    assert gemv_cpu.applies(x, w)
    out = gemv_cpu.gemv_bf16(x, w, b)
    assert out.dtype == torch.bfloat16 and out.shape == (M, N)
    exact = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    assert ((out.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-4).all()


@pytest.mark.skipif(gemv_cpu._library() is None, reason="no C compiler for the CPU kernel")
@pytest.mark.parametrize("M", [1, 2, 3, 4])
def test_gemv_bf16_gives_the_same_bits_with_weight_rows_side_by_side_or_one_at_a_time(M, monkeypatch):
    """The two ways of streaming W (gemv_cpu.side_by_side: which one depends on the CPU) keep
    each column's summation order; N = 4k + 3 takes the side-by-side path's tail too."""
    g = torch.Generator().manual_seed(M)
    x, w, b = (torch.randn(M, 96, generator=g).bfloat16(), torch.randn(83, 96, generator=g).bfloat16(),
               torch.randn(83, generator=g).bfloat16())
    outs = []
    for way in (True, False):
        monkeypatch.setattr(gemv_cpu, "side_by_side", lambda K, way=way: way)
        outs.append(gemv_cpu.gemv_bf16(x, w, b))
    assert torch.equal(outs[0], outs[1])


def test_gemv_rows_side_by_side_on_intel_and_for_long_rows_on_amd_unless_told(monkeypatch):
    from tessera_kernels import cbuild
    for vendor, K, env, expected in (("GenuineIntel", 576, None, True), ("AuthenticAMD", 576, None, False),
                                     ("AuthenticAMD", 1536, None, False), ("AuthenticAMD", 2048, None, True),
                                     ("AuthenticAMD", 576, "1", True), ("GenuineIntel", 8192, "0", False)):
        monkeypatch.setattr(cbuild, "cpu_vendor", lambda vendor=vendor: vendor)
        if env is None:
            monkeypatch.delenv("TESSERA_GEMV_SIDE_BY_SIDE", raising=False)
        else:
            monkeypatch.setenv("TESSERA_GEMV_SIDE_BY_SIDE", env)
        gemv_cpu.side_by_side.cache_clear()
        assert gemv_cpu.side_by_side(K) is expected
    gemv_cpu.side_by_side.cache_clear()


def test_gemv_applies_only_to_few_bf16_rows():
    w = torch.zeros(8, 32, dtype=torch.bfloat16)
    assert not gemv_cpu.applies(torch.zeros(gemv_cpu.MAX_ROWS + 1, 32, dtype=torch.bfloat16), w)
    assert not gemv_cpu.applies(torch.zeros(0, 32, dtype=torch.bfloat16), w)  # a step sampling nothing
    assert not gemv_cpu.applies(torch.zeros(1, 32), w.float())
    assert not gemv_cpu.applies(torch.zeros(1, 24, dtype=torch.bfloat16), torch.zeros(8, 24, dtype=torch.bfloat16))


@pytest.mark.skipif(elementwise_cpu._library() is None, reason="no C compiler for the CPU kernel")
@pytest.mark.parametrize("T,N", [(1, 576), (7, 64), (64, 1536)])
def test_rms_norm_bf16_equals_the_torch_layer(T, N):
    """Same roundings as HF's bf16 RMSNorm; rows read through a stride (a slice of a wider row)."""
    g = torch.Generator().manual_seed(T * N)
    wide = (torch.randn(T, N + 32, generator=g) * 3).bfloat16()
    x = wide[:, 16:16 + N]
    w = (torch.rand(N, generator=g) + 0.5).bfloat16()
    out = elementwise_cpu.rms_norm(x, w, 1e-5)
    ref = rms_norm_low_precision(x, w, 1e-5)
    assert _bf16_ulps(out, ref) <= 1 and (out == ref).float().mean() >= 0.999


@pytest.mark.skipif(elementwise_cpu._library() is None, reason="no C compiler for the CPU kernel")
@pytest.mark.parametrize("T,I", [(1, 1536), (5, 16), (64, 256)])
def test_silu_mul_bf16_equals_torch(T, I):
    g = torch.Generator().manual_seed(T + I)
    gate_up = (torch.randn(T, 2 * I, generator=g) * 6).bfloat16()
    gate_up[0, :4] = torch.tensor([0.0, -0.0, 90.0, -90.0])          # zero, and far into both tails
    gate, up = gate_up.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    out = elementwise_cpu.silu_mul(gate_up)
    assert _bf16_ulps(out, ref) <= 1 and (out == ref).float().mean() >= 0.999


@pytest.mark.skipif(elementwise_cpu._library() is None, reason="no C compiler for the CPU kernel")
@pytest.mark.parametrize("T,heads,D", [(1, 12, 64), (9, 3, 128), (4, 1, 32)])
def test_rope_bf16_in_place_equals_torch(T, heads, D):
    """Rotated in place inside a wider row (query and key heads of a fused qkv output)."""
    g = torch.Generator().manual_seed(T * heads + D)
    qkv = torch.randn(T, (heads + 2) * D, generator=g).bfloat16()
    x = qkv[:, :heads * D].view(T, heads, D)
    tail = qkv[:, heads * D:].clone()
    cos = torch.randn(T, 1, D, generator=g).bfloat16()
    sin = torch.randn(T, 1, D, generator=g).bfloat16()
    ref = x * cos + x.roll(D // 2, dims=-1) * sin
    out = elementwise_cpu.rope_(x, cos, sin)
    assert out.data_ptr() == qkv.data_ptr() and torch.equal(out, ref)
    assert torch.equal(qkv[:, heads * D:], tail)


_f32_kernels = pytest.mark.skipif(elementwise_cpu._library(torch.float32) is None,
                                  reason="no C compiler for the CPU kernel")


def _within_float32_rounding(out: torch.Tensor, exact: torch.Tensor, torch_out: torch.Tensor) -> bool:
    """out as close to the float64 result as torch's own float32 result is, give or take a few
    float32 roundings (another summation order, fused multiply-adds)."""
    torch_err = (torch_out.double() - exact).abs().max()
    return bool(((out.double() - exact).abs() <= 2 * torch_err + exact.abs() * 2.0 ** -21 + 1e-30).all())


@_f32_kernels
@pytest.mark.parametrize("T,N", [(1, 576), (7, 64), (64, 1536)])
def test_rms_norm_float32_equals_the_torch_layer(T, N):
    g = torch.Generator().manual_seed(T * N + 1)
    x = (torch.randn(T, N + 32, generator=g) * 3)[:, 16:16 + N]       # rows read through a stride
    w = torch.rand(N, generator=g) + 0.5
    assert elementwise_cpu.applies(x, N)
    out = elementwise_cpu.rms_norm(x, w, 1e-5)
    exact = F.rms_norm(x.double(), (N,), w.double(), 1e-5)
    assert out.dtype == torch.float32 and _within_float32_rounding(out, exact, F.rms_norm(x, (N,), w, 1e-5))


@_f32_kernels
@pytest.mark.parametrize("T,I", [(1, 1536), (5, 16), (64, 256)])
def test_silu_mul_float32_equals_torch(T, I):
    g = torch.Generator().manual_seed(T + I + 1)
    gate_up = torch.randn(T, 2 * I, generator=g) * 6
    gate_up[0, :4] = torch.tensor([0.0, -0.0, 90.0, -90.0])          # zero, and far into both tails
    gate, up = gate_up.chunk(2, dim=-1)
    out = elementwise_cpu.silu_mul(gate_up)
    exact = F.silu(gate.double()) * up.double()
    assert out.dtype == torch.float32 and _within_float32_rounding(out, exact, F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,N", [(1, 576), (3, 16), (64, 2048)])
def test_residual_add_is_torchs_add_bit_for_bit(dtype, T, N):
    """bf16: the float32 sum rounded once, to nearest even, as torch's add; the last case is
    large enough for both threads."""
    if elementwise_cpu._library(dtype) is None:
        pytest.skip("no C compiler for the CPU kernel")
    g = torch.Generator().manual_seed(T * N)
    a, b = (torch.randn(T, N, generator=g) * 100).to(dtype), torch.randn(T, N, generator=g).to(dtype)
    b[0, :3] = torch.tensor([float("inf"), float("nan"), -0.0])
    out, ref = elementwise_cpu.add(a, b), a + b
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert out.dtype == dtype and torch.equal(out.view(bits)[:, 2:], ref.view(bits)[:, 2:])
    assert out[0, 0] == float("inf") and out[0, 1].isnan() and torch.equal(out[1:].view(bits), ref[1:].view(bits))


@_f32_kernels
@pytest.mark.parametrize("T,heads,D", [(1, 12, 64), (9, 3, 128), (4, 1, 32)])
def test_rope_float32_in_place_equals_torch(T, heads, D):
    g = torch.Generator().manual_seed(T * heads + D + 1)
    qkv = torch.randn(T, (heads + 2) * D, generator=g)
    x = qkv[:, :heads * D].view(T, heads, D)
    tail = qkv[:, heads * D:].clone()
    cos, sin = torch.randn(T, 1, D, generator=g), torch.randn(T, 1, D, generator=g)
    ref = x * cos + x.roll(D // 2, dims=-1) * sin
    exact = x.double() * cos.double() + x.double().roll(D // 2, dims=-1) * sin.double()
    out = elementwise_cpu.rope_(x, cos, sin)
    assert out.data_ptr() == qkv.data_ptr() and _within_float32_rounding(out, exact, ref)
    assert torch.equal(qkv[:, heads * D:], tail)


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between a and b in bf16 steps (same-sign values)."""
    ai, bi = a.view(torch.int16).int(), b.view(torch.int16).int()
    return int((ai - bi).abs().max())


def _q4_weight(N: int, K: int, G: int, seed: int):
    from tessera.layers.quant import quantize_rtn
    g = torch.Generator().manual_seed(seed)
    q = quantize_rtn(torch.randn(N, K, generator=g) * 0.05, 4, G)
    return q, gemv_quant_cpu.Q4Weight(gemv_quant_cpu.pack_q4(q.codes), q.scale.contiguous(), q.offset.contiguous(), K)


@pytest.mark.parametrize("N,K", [(3, 96), (5, 64), (2, 32)])
def test_pack_q4_round_trips_even_with_an_odd_last_run(N, K):
    codes = torch.randint(0, 16, (N, K), dtype=torch.uint8)
    packed = gemv_quant_cpu.pack_q4(codes)
    assert packed.shape == gemv_quant_cpu.packed_q4_shape(N, K) == (N, 32 * -(-K // 64))
    assert torch.equal(gemv_quant_cpu.unpack_q4(packed, K), codes)


@pytest.mark.skipif(not gemv_quant_cpu.available(), reason="no C compiler for the CPU kernel")
@pytest.mark.parametrize("N,K,G", [(960, 576, 32), (17, 96, 32), (33, 1536, 64), (40, 192, 96), (5, 96, 96)])
@pytest.mark.parametrize("M", [1, 2, 5, 16])
def test_gemv_q4_matches_its_reference_and_treats_every_row_alike(N, K, G, M):
    """One row: the exact weights q * s + m in float32. Several rows on an AVX512-BF16 CPU: the
    weights rounded to bf16 first, as the fake-quant reference does. Either way every row of a
    call the same way (M = 5 is a pass of four rows and one of one), within one bf16 rounding
    of the float64 product with those weights."""
    q, w = _q4_weight(N, K, G, seed=N + M)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).bfloat16()
    y = w.gemv(x).double()
    assert y.shape == (M, N)

    def close(weights):
        exact = x.double() @ weights.double().T
        return bool(((y - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-4).all())
    dense = q.dequantize()
    assert close(dense) or close(dense.bfloat16())   # all rows against one of the two


@pytest.mark.skipif(not gemv_quant_cpu.available(), reason="no C compiler for the CPU kernel")
@pytest.mark.parametrize("N,K,G", [(64, 576, 32), (17, 96, 32), (8, 256, 128)])
def test_dequantize_q4_is_the_references_bf16_weight_bit_for_bit(N, K, G):
    q, w = _q4_weight(N, K, G, seed=K)
    assert torch.equal(w.dequantize(), q.dequantize().bfloat16())


def test_q4_weight_rejects_what_the_kernel_cannot_read():
    q, w = _q4_weight(16, 64, 32, seed=0)
    with pytest.raises(ValueError):
        gemv_quant_cpu.Q4Weight(w.packed[:, :16].contiguous(), w.scale, w.offset, 64)     # codes cut short
    with pytest.raises(ValueError):
        gemv_quant_cpu.Q4Weight(w.packed, w.scale.float(), w.offset, 64)                   # float32 scales
    with pytest.raises(ValueError):
        gemv_quant_cpu.Q4Weight(w.packed, w.scale, w.offset, 48)                           # K not in whole runs
    with pytest.raises(ValueError):
        w.gemv(torch.zeros(2, 63, dtype=torch.bfloat16))                                  # x of the wrong width
    with pytest.raises(ValueError):
        gemv_quant_cpu.Q4Weight(torch.zeros(16, 0, dtype=torch.uint8), w.scale[:, :1].contiguous(),
                                w.offset[:, :1].contiguous(), 0)                          # no inputs at all
    meta = gemv_quant_cpu.Q4Weight(w.packed.to("meta"), w.scale.to("meta"), w.offset.to("meta"), 64)
    assert not meta.on_cpu
    with pytest.raises(ValueError):
        meta.gemv(torch.zeros(1, 64, dtype=torch.bfloat16))                               # not CPU memory


@pytest.mark.skipif(not gemv_quant_cpu.available(), reason="no C compiler for the CPU kernel")
@pytest.mark.parametrize("M", [1, 2, 3, 5])
def test_gemv_q8_matches_reference(M):
    from tessera.layers.quant import quantize_rtn
    g = torch.Generator().manual_seed(M)
    q = quantize_rtn(torch.randn(200, 576, generator=g), 8)
    x = torch.randn(M, 576, generator=g).bfloat16()
    y = gemv_quant_cpu.gemv_q8(x, q.codes, q.scale.reshape(-1).contiguous()).double()
    exact = x.double() @ q.dequantize().double().T
    assert ((y - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-4).all()
    with pytest.raises(ValueError):
        gemv_quant_cpu.gemv_q8(x, q.codes, q.scale.reshape(-1)[:10].contiguous())
    with pytest.raises(ValueError):
        gemv_quant_cpu.gemv_q8(x, q.codes.to("meta"), q.scale.reshape(-1).contiguous())


@pytest.mark.skipif(not gemv_quant_cpu.available(), reason="no C compiler for the CPU kernel")
@pytest.mark.skipif("avx512f" not in cbuild.cpu_flags(),
                    reason="this CPU has no AVX-512: its own build is the AVX2 one, which the tests above ran")
def test_the_kernels_built_for_avx2_pass_the_same_tests(tmp_path):
    """The other kind of machine (AVX2 only: the float path, no bf16 dot products, the bf16
    linears' FMA tiles 8 lanes wide and their unpacked panels), built here with
    TESSERA_MARCH=haswell into its own cache: as C++ where g++ is found (cbuild._cxx), else as
    C. Every test of the three files that applies there."""
    import os
    import pathlib
    import subprocess
    import sys
    env = {**os.environ, "TESSERA_MARCH": "haswell", "TESSERA_CACHE": str(tmp_path)}
    others = [str(pathlib.Path(__file__).with_name(f)) for f in ("test_attention_kernel.py", "test_tile_linear.py")]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, *others,
                          "-k", "not avx2"], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "passed" in run.stdout
    flags = cbuild.cpu_flags()
    built = ("gemv_quant", "gemv_bf16", "elementwise_f32", "elementwise_bf16", "argmax_f32", "paged_decode_attention") + (
        ("tile_linear_f32",) if {"avx2", "fma"} <= flags else ()) + (
        ("tile_linear_bf16",) if {"avx2", "fma"} <= flags and "amx_bf16" not in flags else ())
    assert all(list((tmp_path / "kernels").glob(f"{name}-*.so")) for name in built)


@pytest.mark.parametrize("B,V", [(1, 49152), (5, 77), (3, 16), (2, 5)])
def test_argmax_rows_is_torchs_argmax_ties_nans_and_infinities_included(B, V):
    from tessera_kernels import argmax_cpu
    g = torch.Generator().manual_seed(B * V)
    x = torch.randint(-3, 4, (B, V), generator=g).float()     # many ties: the first maximum wins
    x[0, V // 2] = float("inf")
    if B > 1:
        x[1] = float("-inf")                                   # nothing but -inf: index 0
    if B > 2:
        x[2, V - 1] = float("nan")                             # a NaN is the maximum, as in torch
    wide = torch.zeros(B, V + 3)
    wide[:, :V] = x
    for rows in (x, wide[:, :V]):                              # contiguous rows, and rows further apart
        assert torch.equal(argmax_cpu.argmax_rows(rows), rows.argmax(dim=-1))


@pytest.mark.skipif(pa._kv_write_library() is None, reason="no C compiler for the CPU kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_equals_index_copy_from_the_fused_qkv_views(dtype, monkeypatch):
    """K and V are views of the fused QKV output (tokens a QKV row apart); every row lands
    where index_copy_ puts it, and nothing else in the caches moves; a PAD_SLOT row (a replayed
    step's padding) is written nowhere, on both paths. A slot outside the cache (past its end,
    or negative other than PAD_SLOT) is refused before anything is written."""
    g = torch.Generator().manual_seed(7)
    T, H, KV, D, S = 5, 6, 2, 32, 40
    qkv = torch.randn(T, (H + 2 * KV) * D, generator=g).to(dtype).view(T, H + 2 * KV, D)
    k, v = qkv[:, H:H + KV], qkv[:, H + KV:]
    slots = torch.tensor([3, 39, 0, 17, 18])
    caches = [torch.randn(KV, S, D, generator=g).to(dtype) for _ in range(2)]
    want = [c.clone() for c in caches]
    pa.kv_write_ref(k, v, *want, slots)
    reference = pa.kv_write_ref
    monkeypatch.setattr(pa, "kv_write_ref", lambda *a: pytest.fail("took the index_copy_ path"))
    pa.kv_write(k, v, *caches, slots)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
    padded = torch.tensor([3, pa.PAD_SLOT, 0, pa.PAD_SLOT, 18])
    pa.kv_write(k, v, *caches, padded)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])   # the same rows again
    for c in caches:
        c[:, 39].zero_()
        c[:, 17].zero_()
    pa.kv_write(k, v, *caches, padded)
    assert not caches[0][:, [17, 39]].any() and not caches[1][:, [17, 39]].any()
    for c, w in zip(caches, want):
        c[:, [17, 39]] = w[:, [17, 39]]
    ref = [c.clone() for c in caches]
    reference(k, v, *ref, padded)
    assert torch.equal(ref[0], caches[0]) and torch.equal(ref[1], caches[1])
    for bad in ([0, 1, 2, 3, S], [0, -2, 2, 3, 4]):
        with pytest.raises(IndexError):
            pa.kv_write(k, v, *caches, torch.tensor(bad))
        assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
    monkeypatch.setattr(pa, "kv_write_ref", reference)
    pa.kv_write(k, v, caches[0][:, ::2], caches[1][:, ::2], torch.tensor([0, 1, 2, 3, 4]))   # strided: index_copy_
    assert torch.equal(caches[0][:, 0:10:2], k.transpose(0, 1))


@pytest.mark.skipif(not pa.available(), reason="no C compiler for the CPU kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_chunks_by_sdpa_equal_the_kernels_rows(dtype, monkeypatch):
    """A step with a decode token and two prompts from position 0 (13 and 9 tokens), and one
    with a chunk after cached tokens (its rows attend to 22-27 tokens): where SDPA takes
    prompts (AMX machines in bf16, in large steps), it takes the chunks whose last row attends
    to more than CHUNK_CONTEXT_ON_KERNEL_UP_TO tokens, and the kernel the decode row and the
    other chunks' rows (a chunk after cached tokens too); every token's output equals the
    all-kernel step's."""
    from tessera.batch import build_forward_batch
    from tessera.layers import attention
    from tessera.scheduler import ScheduledRequest, StepPlan
    g = torch.Generator().manual_seed(11)
    H, KV, D, bs = 6, 2, 64, 8
    decode = ScheduledRequest("d", (5,), 30, (4, 9, 1, 7), True)
    fresh = [ScheduledRequest("p", tuple(range(13)), 0, (2, 11), True),
             ScheduledRequest("q", tuple(range(9)), 0, (0, 10), True)]
    continued = ScheduledRequest("c", tuple(range(6)), 21, (3, 5, 6, 8), True)
    kernel, rows = pa.paged_decode_attention, []
    monkeypatch.setattr(pa, "paged_decode_attention", lambda q, *a: rows.append(q.shape[0]) or kernel(q, *a))
    # (plan, CHUNK_CONTEXT_ON_KERNEL_UP_TO, the kernel's rows where SDPA takes long chunks)
    two_fresh, with_continued = StepPlan((decode, *fresh)), StepPlan((decode, fresh[0], continued))
    cases = [(two_fresh, 0, 1), (two_fresh, 12, 1 + 9), (two_fresh, 13, 1 + 13 + 9),
             (with_continued, 10, 1), (with_continued, 26, 1 + 13), (with_continued, 27, 1 + 13 + 6)]
    for plan, limit, kernel_rows in cases:
        batch = build_forward_batch(plan, bs)
        T = batch.num_tokens
        q, k, v = (torch.randn(T, h, D, generator=g).to(dtype) for h in (H, KV, KV))
        caches = [torch.randn(KV, 12 * bs, D, generator=g).to(dtype) for _ in range(2)]
        monkeypatch.setattr(attention, "CHUNK_CONTEXT_ON_KERNEL_UP_TO", limit)
        outs = {}
        for sdpa in (False, True):
            rows.clear()
            monkeypatch.setattr(attention, "prompts_by_sdpa", lambda q, sdpa=sdpa: sdpa)
            outs[sdpa] = attention.paged_attention(q, k, v, *(c.clone() for c in caches), batch, D ** -0.5)
            assert rows == ([kernel_rows] if sdpa else [T])
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(outs[True].float(), outs[False].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equal_length_fresh_prompts_share_one_sdpa_call_with_the_same_bits(dtype, monkeypatch):
    """Three fresh prompts of 8 tokens back to back, then one of 5: two SDPA calls (a batch of
    three and the odd one), and every token's output equals one call per prompt."""
    import torch.nn.functional as F

    from tessera.batch import build_forward_batch
    from tessera.layers import attention
    from tessera.scheduler import ScheduledRequest, StepPlan
    g = torch.Generator().manual_seed(5)
    H, KV, D, bs = 6, 2, 64, 8
    plan = StepPlan(tuple(ScheduledRequest(f"r{i}", tuple(range(n)), 0, (2 * i, 2 * i + 1), True)
                          for i, n in enumerate((8, 8, 8, 5))))
    batch = build_forward_batch(plan, bs)
    qkv = torch.randn(batch.num_tokens, (H + 2 * KV) * D, generator=g).to(dtype)   # strided views, as in the model
    q, k, v = qkv[:, :H * D].view(-1, H, D), qkv[:, H * D:(H + KV) * D].view(-1, KV, D), qkv[:, (H + KV) * D:].view(-1, KV, D)
    caches = [torch.zeros(KV, 12 * bs, D, dtype=dtype) for _ in range(2)]
    monkeypatch.setattr(attention, "_kernel_applies", lambda q: False)
    calls, sdpa = [], F.scaled_dot_product_attention
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", lambda q, *a, **kw: calls.append(q.shape[0]) or sdpa(q, *a, **kw))
    out = attention.paged_attention(q, k, v, *caches, batch, D ** -0.5)
    assert calls == [3, 1]
    for c in batch.prefills:
        s, n = c.token_start, c.num_tokens
        one = sdpa(q[s:s + n].transpose(0, 1)[None], k[s:s + n].transpose(0, 1)[None], v[s:s + n].transpose(0, 1)[None],
                   is_causal=True, scale=D ** -0.5, enable_gqa=True)[0].transpose(0, 1)
        assert torch.equal(out[s:s + n], one)


def test_only_bf16_prompts_of_large_steps_go_to_sdpa_and_only_where_the_cpu_has_amx():
    from tessera.layers.attention import PROMPTS_ON_KERNEL_UP_TO, prompts_by_sdpa
    from tessera_kernels import cbuild
    amx = "amx_bf16" in cbuild.cpu_flags()
    large = PROMPTS_ON_KERNEL_UP_TO + 1
    assert prompts_by_sdpa(torch.zeros(large, 1, 64, dtype=torch.bfloat16)) == amx
    assert not prompts_by_sdpa(torch.zeros(PROMPTS_ON_KERNEL_UP_TO, 1, 64, dtype=torch.bfloat16))   # replayable steps
    assert not prompts_by_sdpa(torch.zeros(large, 1, 64))


@pytest.mark.skipif(not amx_linear.available(), reason="this CPU has no AMX (amx_bf16): the AMX linear is not built")
@pytest.mark.parametrize("M", [5, 16, 17, 31, 32, 33, 40, 48, 64, 65, 100, 128, 300])
@pytest.mark.parametrize("N,K,bias", [(960, 576, False), (576, 1536, True), (32, 32, True)])
def test_amx_linear_matches_its_reference_and_onednn(M, N, K, bias):
    """Row counts on and off the 16-row tiles (a padded last block), with a bias, and x a view
    whose rows are further apart than K: close to the float32 reference, and oneDNN's bf16
    linear (bit for bit up to 32 rows on the AMX CPUs tested, where the tile products run in the
    same order; above 32 rows about one element in 10^4 differs in the last bit)."""
    g = torch.Generator().manual_seed(M * N + K)
    w = torch.randn(N, K, generator=g).bfloat16()
    x = torch.randn(M, K + 64, generator=g).bfloat16()[:, 32:32 + K]
    b = torch.randn(N, generator=g).bfloat16() if bias else None
    y = amx_linear.linear(x, amx_linear.pack(w), b, N)
    ref = amx_linear.linear_ref(x, w, b)
    torch.testing.assert_close(y.float(), ref.float(), rtol=1.6e-2, atol=1e-2)
    onednn = torch.ops.mkldnn._linear_pointwise(x.contiguous(), torch.ops.mkldnn._reorder_linear_weight(w, None),
                                                b, "none", [], "")
    assert (y != onednn).float().mean().item() <= 1e-3


def test_amx_linear_applies_from_five_rows_of_bf16_tiles():
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    ok = amx_linear.available()
    assert amx_linear.applies(torch.zeros(8, 64, dtype=torch.bfloat16), w) == ok
    assert not amx_linear.applies(torch.zeros(4, 64, dtype=torch.bfloat16), w)        # the GEMV's
    assert amx_linear.applies(torch.zeros(64, 64, dtype=torch.bfloat16), w) == ok     # a batch-64 decode
    assert amx_linear.applies(torch.zeros(2048, 64, dtype=torch.bfloat16), w) == ok   # a prompt chunk
    assert not amx_linear.applies(torch.zeros(8, 64), w.float())
    assert not amx_linear.applies(torch.zeros(8, 48, dtype=torch.bfloat16), torch.zeros(64, 48, dtype=torch.bfloat16))
    assert not amx_linear.applies(torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(48, 64, dtype=torch.bfloat16))


@pytest.mark.skipif(not amx_linear.available(), reason="this CPU has no AMX (amx_bf16): the AMX linear is not built")
def test_linear_layer_takes_the_amx_path_for_mid_batches(monkeypatch):
    """The layer sends 5 bf16 rows or more to the AMX kernel (spied), with the same result as the
    oneDNN path it replaces, and packs again after its weight changes."""
    from tessera.layers.linear import Linear
    layer = Linear(64, 96, bias=True).bfloat16().requires_grad_(False)
    x = torch.randn(12, 64).bfloat16()
    calls = []
    real = amx_linear.linear
    monkeypatch.setattr(amx_linear, "linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    with torch.inference_mode():
        y = layer(x)
        want = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(layer.weight, None),
                                                  layer.bias, "none", [], "")
        assert calls == [12] and torch.equal(y, want)
        layer.weight.mul_(2)
        assert torch.equal(layer(x), real(x, amx_linear.pack(layer.weight), layer.bias, 96))
