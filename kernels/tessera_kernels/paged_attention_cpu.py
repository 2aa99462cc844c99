"""Paged decode attention for the CPU: a torch reference and a C kernel (csrc/) that reads
K/V straight from the paged cache (float32 or bfloat16) instead of gathering them first; and
the writes of new K/V rows into that cache (kv_write, csrc/kv_write.c).

The C source is built on first use by cbuild.py; without a compiler the caller falls back
to the reference.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from tessera_kernels import cbuild, tile_linear


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               block_size: int, scale: float, bf16_probs: bool = False, window: int = 0,
                               softcap: float = 0.0) -> torch.Tensor:
    """q [B, H, D]; caches [KV, S, D]; block_tables [B, W]; context_lens [B] -> [B, H, D].
    Row b is the query at position L - 1 (L = context_lens[b]) over its tokens 0..L-1;
    window > 0: only its last `window` tokens (a sliding window); softcap > 0: the scaled
    scores s become softcap * tanh(s / softcap) (Gemma 2's soft-capping).
    bf16_probs: the softmax's numerators rounded to bf16 before they weight V, the sum kept
    unrounded (what the C kernel does with a bf16 cache where probabilities_in_bf16(), and
    torch's SDPA for bf16)."""
    B, H, D = q.shape
    KV = k_cache.shape[0]
    out = torch.empty_like(q)
    for b in range(B):
        L = int(context_lens[b])
        t = torch.arange(max(0, L - window) if window > 0 else 0, L)
        slots = block_tables[b, t // block_size] * block_size + t % block_size
        k = k_cache[:, slots].repeat_interleave(H // KV, dim=0)       # [H, L, D]
        v = v_cache[:, slots].repeat_interleave(H // KV, dim=0)
        s = (q[b].unsqueeze(1) @ k.transpose(1, 2)).squeeze(1) * scale
        if softcap > 0:
            s = torch.tanh(s / softcap) * softcap
        if bf16_probs:
            e = torch.exp(s - s.amax(-1, keepdim=True))
            out[b] = (e.bfloat16().to(e.dtype).unsqueeze(1) @ v).squeeze(1) / e.sum(-1, keepdim=True)
        else:
            out[b] = (torch.softmax(s, dim=-1).unsqueeze(1) @ v).squeeze(1)
    return out


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cbuild.load("paged_decode_attention", tile_linear.without_dot_bf16())
    if lib is not None:
        lib.paged_decode_attention.restype = None
        lib.probabilities_in_bf16.restype = ctypes.c_int
        lib.paged_decode_attention_tiles.restype = ctypes.c_int
        lib.paged_decode_attention_tiles.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 5
        lib.paged_decode_attention.argtypes = ([ctypes.c_void_p] * 6 + [ctypes.c_int] * 6
                                               + [ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_int,
                                                  ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_int])
    return lib


def available() -> bool:
    """True when the C kernel is built (TESSERA_DISABLE_CPU_KERNELS=1 turns it off)."""
    return _library() is not None


def probabilities_in_bf16(head_dim: int) -> bool:
    """Whether the built kernel, with a bf16 cache and this head size, rounds the softmax's
    numerators to bf16 before the V pass (AVX512-BF16 builds, head sizes a multiple of 32)."""
    lib = _library()
    return lib is not None and bool(lib.probabilities_in_bf16()) and head_dim % 32 == 0


def tiles_planned(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, head_dim: int,
                  dtype: torch.dtype) -> int:
    """How many tiles (up to 16 rows of one prompt chunk attended together) the kernel makes
    of these rows: a test's check that the tile path runs."""
    lib = _library()
    assert lib is not None
    tables, lens = block_tables.contiguous(), context_lens.contiguous()
    return lib.paged_decode_attention_tiles(tables.data_ptr(), lens.data_ptr(), tables.shape[0], tables.shape[1],
                                            block_size, head_dim, int(dtype == torch.bfloat16))


def supports(head_dim: int) -> bool:
    """The kernel works on 16 floats at a time (one AVX-512 register, two AVX2 ones)."""
    return head_dim % 16 == 0 and head_dim <= 256


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           block_size: int, scale: float, window: int = 0, softcap: float = 0.0,
                           tiles: bool = True) -> torch.Tensor:
    """The C kernel; same contract as paged_decode_attention_ref (with bf16_probs where
    probabilities_in_bf16). `scale` is used as given (a family's query scale). With a window or
    soft-capping a prompt chunk's rows go one at a time (the prompt tiles take neither yet);
    tiles=False sends every row alone, as a decode row (the batch-invariant mode). The caches are float32 or bfloat16; q and the result are in the
    caches' dtype (the kernel reads and writes them as they are), the arithmetic is float32."""
    B, H, D = q.shape
    KV, S, Dk = k_cache.shape
    dtype = k_cache.dtype
    assert dtype in (torch.float32, torch.bfloat16) and q.dtype == v_cache.dtype == dtype
    assert Dk == D and supports(D) and v_cache.shape == k_cache.shape and H % KV == 0 and H // KV <= 64
    assert block_tables.dtype == context_lens.dtype == torch.int64 and block_tables.shape[0] == B
    assert block_size > 0 and block_size & (block_size - 1) == 0, "block_size: a power of two"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    lib = _library()
    assert lib is not None, "kernel unavailable: use paged_decode_attention_ref"
    if q.stride(2) != 1 or q.stride(1) != D:
        q = q.contiguous()
    block_tables = block_tables.contiguous()
    context_lens = context_lens.contiguous()
    out = torch.empty(B, H, D, dtype=dtype)
    lib.paged_decode_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                               block_tables.data_ptr(), context_lens.data_ptr(), out.data_ptr(),
                               B, H, KV, D, block_tables.shape[1], block_size, S, scale,
                               torch.get_num_threads(), int(dtype == torch.bfloat16), q.stride(0), window, softcap,
                               int(tiles))
    return out


PAD_SLOT = -1   # a padding row of a replayed step (step_graph.py): its K/V are not written


def kv_write_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor) -> None:
    """k, v [T, KV, D] into caches [KV, S, D] at rows slots [T]; rows at PAD_SLOT are skipped."""
    keep = slots != PAD_SLOT
    if not bool(keep.all()):
        k, v, slots = k[keep], v[keep], slots[keep]
    k_cache.index_copy_(1, slots, k.transpose(0, 1))
    v_cache.index_copy_(1, slots, v.transpose(0, 1))


@functools.cache
def _kv_write_library() -> ctypes.CDLL | None:
    lib = cbuild.load("kv_write")
    if lib is not None:
        lib.kv_write.restype = ctypes.c_int
        lib.kv_write.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3 \
            + [ctypes.c_int] * 3 + [ctypes.c_int64, ctypes.c_int]
    return lib


def kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """kv_write_ref's contract, one memcpy per row (csrc/kv_write.c) where it applies: CPU
    tensors of one dtype, each token's heads contiguous, contiguous caches; elsewhere
    index_copy_. A slot outside the cache (other than PAD_SLOT) raises IndexError on both paths
    (the C code checks every slot before it writes any)."""
    T, KV, D = k.shape
    lib = _kv_write_library()
    on_cpu = all(t.device.type == "cpu" for t in (k, v, k_cache, v_cache, slots))
    fits = (lib is not None and on_cpu and k.dtype == v.dtype == k_cache.dtype == v_cache.dtype
            and k.shape == v.shape and k_cache.shape == v_cache.shape and k_cache.shape[0] == KV
            and k_cache.shape[2] == D and k.stride(2) == v.stride(2) == 1 and k.stride(1) == v.stride(1) == D
            and k_cache.is_contiguous() and v_cache.is_contiguous() and slots.dtype == torch.int64
            and slots.shape == (T,) and slots.is_contiguous())
    if not fits or T == 0:
        return kv_write_ref(k, v, k_cache, v_cache, slots)
    S = k_cache.shape[1]
    if lib.kv_write(k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                    slots.data_ptr(), T, KV, D, S, k.element_size()) != 0:
        raise IndexError(f"KV slot outside the cache's {S} rows")
