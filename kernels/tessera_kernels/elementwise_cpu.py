"""The bf16 elementwise steps of a decoder layer (RMSNorm, SwiGLU's activation, RoPE) as one
C pass each (csrc/elementwise_bf16.c) in place of the four or five torch ops the same math
takes; at batch 64 on 2 cores the torch ops cost ~6 of a ~55 ms decode step. The torch
form of each stays in its layer (layers/norm.py, mlp.py, rope.py), which uses it where
`applies` says no; the tests compare the two.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from tessera_kernels import cbuild


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cbuild.load("elementwise_bf16")
    if lib is not None:
        p, i64, i, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        lib.rms_norm_bf16.argtypes = [p, i64, p, p, i64, i, i, f, i]
        lib.silu_mul_bf16.argtypes = [p, i64, p, i, i, i]
        lib.rope_bf16.argtypes = [p, i64, p, p, i, i, i, i]
        for fn in (lib.rms_norm_bf16, lib.silu_mul_bf16, lib.rope_bf16):
            fn.restype = None
    return lib


def applies(x: torch.Tensor, width: int) -> bool:
    """bf16 on the CPU, rows of `width` values, width a multiple of 16, at least one row,
    each row contiguous, and the kernels built."""
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.shape[0] > 0 and width % 16 == 0
            and x.stride(-1) == 1 and _library() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, N] bf16 (rows contiguous), weight [N] bf16 -> [T, N]."""
    T, N = x.shape
    assert weight.dtype == torch.bfloat16 and weight.shape == (N,) and weight.is_contiguous()
    y = torch.empty(T, N, dtype=torch.bfloat16)
    _library().rms_norm_bf16(x.data_ptr(), x.stride(0), weight.data_ptr(), y.data_ptr(), N, T, N, eps,
                             torch.get_num_threads())
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] bf16 (gate, then up, in each row) -> silu(gate) * up [T, I]."""
    T, two_i = gate_up.shape
    y = torch.empty(T, two_i // 2, dtype=torch.bfloat16)
    _library().silu_mul_bf16(gate_up.data_ptr(), gate_up.stride(0), y.data_ptr(), T, two_i // 2,
                             torch.get_num_threads())
    return y


def rope_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] bf16 rotated in place (heads contiguous within a token); cos and
    signed_sin [T, 1, D] bf16, contiguous. D a multiple of 32."""
    T, heads, D = x.shape
    assert D % 32 == 0 and x.stride(2) == 1 and x.stride(1) == D
    assert cos.dtype == signed_sin.dtype == torch.bfloat16 and cos.is_contiguous() and signed_sin.is_contiguous()
    assert cos.shape == signed_sin.shape == (T, 1, D)
    _library().rope_bf16(x.data_ptr(), x.stride(0), cos.data_ptr(), signed_sin.data_ptr(), T, heads, D,
                         torch.get_num_threads())
    return x
