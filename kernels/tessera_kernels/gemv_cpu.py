"""bf16 linear for a few rows (decode at batch 1 to 4): a torch reference and a C kernel
(csrc/gemv_bf16.c) that streams each weight once for all rows at the memory's speed.

torch's bf16 matmul reads the weights of a one-row product at under half the bandwidth the
CPU streams memory, this kernel close to a plain read's, and a decode step at batch 1 is
nothing but reading every weight once.
"""
from __future__ import annotations

import ctypes
import functools
import os

import torch
import torch.nn.functional as F

from tessera_kernels import cbuild

MAX_ROWS = 4   # as csrc/gemv_bf16.c; at 8 rows torch's GEMM is as fast


def gemv_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The float32 product of the same bf16 values, rounded to bf16 once."""
    return F.linear(x.float(), w.float(), None if bias is None else bias.float()).bfloat16()


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cbuild.load("gemv_bf16")
    if lib is not None:
        lib.gemv_bf16.restype = None
        lib.gemv_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 5
    return lib


# On AMD EPYC, weight rows at least this long (bf16 elements: 4 KiB) stream side by side too.
AMD_SIDE_BY_SIDE_FROM_K = 2048


@functools.cache
def side_by_side(K: int) -> bool:
    """Whether the kernel streams several weight rows of length K side by side (csrc/gemv_bf16.c's
    COLUMNS(M): four with AVX-512; with AVX2 4/2/1 for 1/2/3+ rows), several FMA chains in flight,
    or one at a time, whichever each CPU kind ran faster with the weights coming from memory:
    side by side on Intel Xeons; on AMD EPYC one at a time for short rows (SmolLM2's K of 576
    and 1536, where several streams from memory get less bandwidth than one) and side by side
    from K = 2048 (a 1B model's 2048 and 8192, where one column's chain of K / 16 dependent FMAs
    left the weights read at about three quarters of the side-by-side rate on Zen 4; the long
    rows are untested on the AVX2-only Zen 2 and 3). Other vendors get side by side, untested.
    Both give the same bits. TESSERA_GEMV_SIDE_BY_SIDE=1|0 chooses instead."""
    chosen = os.environ.get("TESSERA_GEMV_SIDE_BY_SIDE")
    if chosen in ("0", "1"):
        return chosen == "1"
    return cbuild.cpu_vendor() != "AuthenticAMD" or K >= AMD_SIDE_BY_SIDE_FROM_K


def available() -> bool:
    return _library() is not None


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the kernel takes this product: bf16 on the CPU, few rows, K a multiple of 16."""
    return (x.dtype == w.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2
            and 1 <= x.shape[0] <= MAX_ROWS and x.shape[1] == w.shape[1] and w.shape[1] % 16 == 0
            and w.is_contiguous()
            and available())


def gemv_bf16(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T (+ bias [N]) -> [M, N], all bf16; callers check applies() first."""
    M, K = x.shape
    N = w.shape[0]
    x = x.contiguous()
    y = torch.empty(M, N, dtype=torch.bfloat16)
    b = None if bias is None else bias.contiguous()
    _library().gemv_bf16(x.data_ptr(), w.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(),
                         M, N, K, torch.get_num_threads(), int(side_by_side(K)))
    return y
