"""bf16 linear on AMX tiles for 5 rows or more (decode batches and prompt chunks;
csrc/amx_linear_bf16.c), with its weight packed once into the tiles' layout. Where the CPU has
no AMX or the C compiler cannot target it, available() is False and callers keep oneDNN;
TESSERA_DISABLE_AMX_LINEAR=1 does the same on purpose (to compare the two).

Against oneDNN's blocked weights, with the weights streamed from memory, this kernel is faster
up to 32 rows. At 48 and 64 rows the two are about even, and this kernel takes them anyway: a
ctypes call can be recorded and replayed (step_graph.py), oneDNN's cannot, and a replayed step
is faster than an eager one. Prompt chunks (65 rows and more) come here too: loading W's tiles
with the streaming hint makes the kernel faster than oneDNN there as well
(`python bench/linears_streamed.py 128 512 2048` compares them), and a prompt step made of
these calls only can be recorded like a decode step. The measurements are in
docs/performance-notes.md.
At 5 to 32 rows the results equal oneDNN's bit for bit (the same tile products in the same
order); above 32 rows about one element in 10^4 differs in the last bit (as the register
tiles' on AMD, tile_linear.py).
"""
from __future__ import annotations

import ctypes
import functools
import os

import torch

from tessera_kernels import cbuild

MIN_ROWS = 5   # below: the GEMV kernel (gemv_cpu)


@functools.cache
def _library() -> ctypes.CDLL | None:
    if "amx_bf16" not in cbuild.cpu_flags() or os.environ.get("TESSERA_DISABLE_AMX_LINEAR") == "1":
        return None
    lib = cbuild.load("amx_linear_bf16")
    if lib is None or lib.amx_linear_init() != 0:
        return None
    lib.amx_linear_bf16.restype = ctypes.c_int
    lib.amx_linear_bf16.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4
    return lib


def available() -> bool:
    return _library() is not None


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """bf16 on the CPU, at least MIN_ROWS rows, each contiguous and at least K apart (not an
    expanded view), N and K multiples of 32, and the kernel built for AMX."""
    return (x.dtype == w.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2
            and MIN_ROWS <= x.shape[0] and x.stride(1) == 1 and x.stride(0) >= x.shape[1]
            and w.dim() == 2 and w.is_contiguous() and x.shape[1] == w.shape[1]
            and w.shape[0] % 32 == 0 and w.shape[1] % 32 == 0 and available())


def pack(w: torch.Tensor) -> torch.Tensor:
    """W [N, K] in the kernel's tile order (see the C source): [N/32, K/32, 2, 16, 16, 2]."""
    N, K = w.shape
    return w.view(N // 32, 2, 16, K // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, N: int) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, N] bf16, W given packed; callers check applies() first."""
    M, K = x.shape
    y = torch.empty(M, N, dtype=torch.bfloat16)
    b = None if bias is None else bias.to(torch.bfloat16).contiguous()   # the kernel reads a bf16 bias
    if _library().amx_linear_bf16(x.data_ptr(), x.stride(0), packed.data_ptr(),
                                  None if b is None else b.data_ptr(), y.data_ptr(), M, N, K,
                                  torch.get_num_threads()) != 0:
        raise MemoryError("amx_linear_bf16: rows out of range or no memory for the padded ones")
    return y


def linear_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The float32 product of the same bf16 values, rounded to bf16 once."""
    return torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float()).bfloat16()
