"""Greedy sampling's argmax over the vocabulary as one vectorized C pass per row
(csrc/argmax_f32.c): torch's CPU argmax along the last dimension is not vectorized, and at
batch 64 it cost more than the rest of sampling together. Same answer as torch.argmax (the
first maximum; the first NaN if there is one); tests compare the two."""
from __future__ import annotations

import ctypes
import functools

import torch

from tessera_kernels import cbuild


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cbuild.load("argmax_f32")
    if lib is not None:
        lib.argmax_rows_f32.restype = None
        lib.argmax_rows_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                                        ctypes.c_int64, ctypes.c_int]
    return lib


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, V] -> [B] int64, as x.argmax(dim=-1); the C pass for float32 rows on the CPU."""
    if (x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[1] == 0
            or x.stride(1) != 1 or _library() is None):
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.long)
    if x.shape[0]:
        _library().argmax_rows_f32(x.data_ptr(), x.stride(0), out.data_ptr(), x.shape[0], x.shape[1],
                                   torch.get_num_threads())
    return out
