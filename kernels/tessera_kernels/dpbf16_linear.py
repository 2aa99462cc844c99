"""bf16 linear by AVX512-BF16 register tiles (csrc/dpbf16_linear.c), with its weight packed
once into the kernel's panels, for CPUs that have AVX512-BF16 and no AMX (AMD Zen 4 and Zen 5):
there a decode step at batch 64 and every prompt chunk are bound by the bf16 dot-product
units, and oneDNN's matmul leaves a third of them idle. Where the CPU has no AVX512-BF16, or
has AMX (oneDNN and the AMX kernel run it), available() is False and callers keep oneDNN;
TESSERA_DISABLE_DPBF16_LINEAR=1 does the same on purpose (A/B measurements).
"""
from __future__ import annotations

import ctypes
import functools
import os

import torch

from tessera_kernels import cbuild

MIN_ROWS = 5   # below: the GEMV kernel (gemv_cpu), which streams the weights at memory speed
NV_MAX = 3     # 16-column blocks per panel, as in the C source


@functools.cache
def _library() -> ctypes.CDLL | None:
    flags = cbuild.cpu_flags()
    if ("avx512_bf16" not in flags or "amx_bf16" in flags
            or os.environ.get("TESSERA_DISABLE_DPBF16_LINEAR") == "1"):
        return None
    lib = cbuild.load("dpbf16_linear")
    if lib is None or lib.dpbf16_linear_built() != 1:
        return None
    lib.dpbf16_linear.restype = ctypes.c_int
    lib.dpbf16_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4
    return lib


def available() -> bool:
    return _library() is not None


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """bf16 on the CPU, at least MIN_ROWS rows each contiguous and at least K apart (not an
    expanded view), N a multiple of 16, K even, and the kernel built for AVX512-BF16."""
    return (x.dtype == w.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2
            and x.shape[0] >= MIN_ROWS and x.stride(1) == 1 and x.stride(0) >= x.shape[1]
            and w.dim() == 2 and w.shape[0] % 16 == 0 and w.shape[1] % 2 == 0 and available())


def pack(w: torch.Tensor) -> torch.Tensor:
    """W [N, K] in the kernel's panel order (see the C source): full panels of NV_MAX blocks of
    16 columns as [K/2, NV_MAX, 16, 2], then the last, narrower panel the same way."""
    N, K = w.shape
    full = N // (16 * NV_MAX) * 16 * NV_MAX
    parts = []
    for start, stop, nv in ((0, full, NV_MAX), (full, N, (N - full) // 16)):
        if stop > start:
            part = w[start:stop].reshape(-1, nv, 16, K // 2, 2)          # [panel, block, j, p, q]
            parts.append(part.permute(0, 3, 1, 2, 4).reshape(-1))        # [panel, p, block, j, q]
    return torch.cat(parts).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, N: int) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, N] bf16, W given packed; callers check applies() first."""
    M, K = x.shape
    y = torch.empty(M, N, dtype=torch.bfloat16)
    b = None if bias is None else bias.float().contiguous()   # the kernel adds a float32 bias
    if _library().dpbf16_linear(x.data_ptr(), x.stride(0), packed.data_ptr(),
                                None if b is None else b.data_ptr(), y.data_ptr(), M, N, K,
                                torch.get_num_threads()) != 0:
        raise ValueError(f"dpbf16_linear: shapes out of range (M={M}, N={N}, K={K})")
    return y
