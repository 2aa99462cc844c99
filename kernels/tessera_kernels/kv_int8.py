"""An int8 paged KV cache for the CPU (--kv-cache-dtype int8): the row layout, its torch
reference (quantize, dequantize, attention), and the C kernels that write it (csrc/kv_write.c,
kv_write_int8) and attend over it (csrc/paged_decode_attention_int8.c).

A cache is int8 [KV, S, D + 4]: row (h, slot) holds the token's head h as D int8 values and
then their float32 scale max|x| / 127 (symmetric, dynamic: set when the row is written). The
scale sits in the row so that anything that moves a row (a tree's accepted nodes, keep_path)
moves its scale with it, and the slot layout is the 16-bit cache's.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from tessera_kernels import cbuild
from tessera_kernels.paged_attention_cpu import PAD_SLOT, paged_decode_attention_ref, supports

SCALE_BYTES = 4


def row_bytes(head_dim: int) -> int:
    """Bytes of one cache row (a slot's one KV head): values and scale."""
    return head_dim + SCALE_BYTES


def head_dim_of(cache: torch.Tensor) -> int:
    return cache.shape[-1] - SCALE_BYTES


def quantize_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> int8 rows [..., D + 4]; the C kernel's bytes exactly (rint(x * 127 / amax),
    half to even, in float32; an all-zero row: scale 0)."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    # a true division (torch's 127.0 / amax is 127 * (1 / amax), another rounding than C's)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv).clamp(-127, 127).to(torch.int8)
    scale = (amax / 127.0).contiguous().view(torch.int8)      # the float32's 4 bytes
    return torch.cat([q, scale], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., D + 4] -> [..., D] in dtype (value times its row's scale, in float32)."""
    D = head_dim_of(rows)
    scale = rows[..., D:].contiguous().view(torch.float32)
    return (rows[..., :D].float() * scale).to(dtype)


def kv_write_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor) -> None:
    """k, v [T, KV, D] quantized into int8 caches [KV, S, D + 4] at rows slots [T]; PAD_SLOT
    rows skipped."""
    keep = slots != PAD_SLOT
    k, v, slots = k[keep], v[keep], slots[keep]
    k_cache.index_copy_(1, slots, quantize_ref(k).transpose(0, 1))
    v_cache.index_copy_(1, slots, quantize_ref(v).transpose(0, 1))


def paged_decode_attention_int8_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                                    scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """paged_decode_attention_ref over the dequantized caches, in float32, returned in q's dtype."""
    out = paged_decode_attention_ref(q.float(), dequantize(k_cache, torch.float32), dequantize(v_cache, torch.float32),
                                     block_tables, context_lens, block_size, scale, window=window, softcap=softcap)
    return out.to(q.dtype)


@functools.cache
def _attention_library() -> ctypes.CDLL | None:
    lib = cbuild.load("paged_decode_attention_int8")
    if lib is not None:
        lib.paged_decode_attention_int8.restype = None
        lib.paged_decode_attention_int8.argtypes = (
            [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6
            + [ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_float])
    return lib


@functools.cache
def _write_library() -> ctypes.CDLL | None:
    lib = cbuild.load("kv_write")
    if lib is not None:
        lib.kv_write_int8.restype = ctypes.c_int
        lib.kv_write_int8.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3 \
            + [ctypes.c_int] * 3 + [ctypes.c_int64, ctypes.c_int]
    return lib


def available() -> bool:
    """Whether the int8 attention kernel is built (TESSERA_DISABLE_CPU_KERNELS=1: no)."""
    return _attention_library() is not None


def applies(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether paged_decode_attention_int8 takes these rows (else the caller dequantizes)."""
    D = head_dim_of(cache)
    return (q.dtype in (torch.float32, torch.bfloat16) and q.device.type == "cpu" and q.shape[-1] == D
            and supports(D) and q.shape[1] // cache.shape[0] * D // 16 <= 1024 and available())


def kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """kv_write_ref's contract, in C where it applies (as paged_attention_cpu.kv_write: a slot
    outside the cache raises IndexError on both paths)."""
    T, KV, D = k.shape
    lib = _write_library()
    fits = (lib is not None and all(t.device.type == "cpu" for t in (k, v, k_cache, v_cache, slots))
            and k.dtype == v.dtype and k.dtype in (torch.float32, torch.bfloat16) and k.shape == v.shape
            and k_cache.dtype == v_cache.dtype == torch.int8 and k_cache.shape == v_cache.shape
            and k_cache.shape[0] == KV and k_cache.shape[2] == row_bytes(D) and D <= 256
            and k.stride(2) == v.stride(2) == 1 and k.stride(1) == v.stride(1) == D
            and k_cache.is_contiguous() and v_cache.is_contiguous() and slots.dtype == torch.int64
            and slots.shape == (T,) and slots.is_contiguous())
    if not fits or T == 0:
        return kv_write_ref(k, v, k_cache, v_cache, slots)
    S = k_cache.shape[1]
    if lib.kv_write_int8(k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), k_cache.data_ptr(),
                         v_cache.data_ptr(), slots.data_ptr(), T, KV, D, S, k.element_size()) != 0:
        raise IndexError(f"KV slot outside the cache's {S} rows")


def paged_decode_attention_int8(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                                scale: float, window: int = 0, softcap: float = 0.0,
                                tiles: bool = True) -> torch.Tensor:
    """The C kernel; paged_decode_attention_int8_ref's contract (q and the result float32 or
    bfloat16, the arithmetic float32). It has no prompt tiles: every row goes alone, whatever
    `tiles` (paged_attention_cpu.paged_decode_attention's) says."""
    B, H, D = q.shape
    KV, S, R = k_cache.shape
    assert k_cache.dtype == v_cache.dtype == torch.int8 and R == row_bytes(D) and v_cache.shape == k_cache.shape
    assert q.dtype in (torch.float32, torch.bfloat16) and supports(D) and H % KV == 0 and (H // KV) * D // 16 <= 1024
    assert H // KV <= 64
    assert block_tables.dtype == context_lens.dtype == torch.int64 and block_tables.shape[0] == B
    assert block_size > 0 and block_size & (block_size - 1) == 0, "block_size: a power of two"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    lib = _attention_library()
    assert lib is not None, "kernel unavailable: use paged_decode_attention_int8_ref"
    if q.stride(2) != 1 or q.stride(1) != D:
        q = q.contiguous()
    block_tables, context_lens = block_tables.contiguous(), context_lens.contiguous()
    out = torch.empty(B, H, D, dtype=q.dtype)
    lib.paged_decode_attention_int8(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                                    context_lens.data_ptr(), out.data_ptr(), B, H, KV, D, block_tables.shape[1],
                                    block_size, S, scale, torch.get_num_threads(), int(q.dtype == torch.bfloat16),
                                    q.stride(0), window, softcap)
    return out
