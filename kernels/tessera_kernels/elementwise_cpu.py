"""The elementwise steps of a decoder layer (RMSNorm, SwiGLU's activation, RoPE, the residual
additions) as one C pass each, in bf16 (csrc/elementwise_bf16.c: torch's roundings) and
float32 (csrc/elementwise_f32.c), in place of the four to ten torch ops the same math takes;
at batch 64 on 2 cores the bf16 torch ops cost ~6 of a ~55 ms decode step, and torch's float32
RMSNorm ~90 µs a call on a slow CPU.
The torch form of each stays in its layer (layers/norm.py, mlp.py, rope.py), which uses it
where `applies` says no; the tests compare the two.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from tessera_kernels import cbuild

_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


@functools.cache
def _library(dtype: torch.dtype = torch.bfloat16) -> ctypes.CDLL | None:
    lib = cbuild.load(f"elementwise_{_SUFFIX[dtype]}")
    if lib is not None:
        p, i64, i, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        s = _SUFFIX[dtype]
        for name, args in ((f"rms_norm_{s}", [p, i64, p, p, i64, i, i, f, i]),
                           (f"silu_mul_{s}", [p, i64, p, i, i, i]),
                           (f"rope_{s}", [p, i64, p, p, i, i, i, i]),
                           (f"add_{s}", [p, p, p, i64, i])):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, None
    return lib


def _fn(x: torch.Tensor, name: str):
    return getattr(_library(x.dtype), f"{name}_{_SUFFIX[x.dtype]}")


def applies(x: torch.Tensor, width: int) -> bool:
    """bf16 or float32 on the CPU, rows of `width` values, width a multiple of 16, at least
    one row, each row contiguous, and the kernels built."""
    return (x.dtype in _SUFFIX and x.device.type == "cpu" and x.shape[0] > 0 and width % 16 == 0
            and x.stride(-1) == 1 and _library(x.dtype) is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, N] (rows contiguous), weight [N] of x's dtype -> [T, N]."""
    T, N = x.shape
    assert weight.dtype == x.dtype and weight.shape == (N,) and weight.is_contiguous()
    y = torch.empty(T, N, dtype=x.dtype)
    _fn(x, "rms_norm")(x.data_ptr(), x.stride(0), weight.data_ptr(), y.data_ptr(), N, T, N, eps,
                       torch.get_num_threads())
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate, then up, in each row) -> silu(gate) * up [T, I]."""
    T, two_i = gate_up.shape
    y = torch.empty(T, two_i // 2, dtype=gate_up.dtype)
    _fn(gate_up, "silu_mul")(gate_up.data_ptr(), gate_up.stride(0), y.data_ptr(), T, two_i // 2,
                             torch.get_num_threads())
    return y


def rope_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated in place (heads contiguous within a token); cos and signed_sin
    [T, 1, D] of x's dtype, contiguous. D a multiple of 32."""
    T, heads, D = x.shape
    assert D % 32 == 0 and x.stride(2) == 1 and x.stride(1) == D
    assert cos.dtype == signed_sin.dtype == x.dtype and cos.is_contiguous() and signed_sin.is_contiguous()
    assert cos.shape == signed_sin.shape == (T, 1, D)
    _fn(x, "rope")(x.data_ptr(), x.stride(0), cos.data_ptr(), signed_sin.data_ptr(), T, heads, D,
                   torch.get_num_threads())
    return x


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b for two contiguous tensors of one shape and dtype, as torch adds them (bf16: the
    float32 sum rounded once); the sizes a multiple of 16."""
    assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous() and b.is_contiguous()
    y = torch.empty(a.shape, dtype=a.dtype)
    _fn(a, "add")(a.data_ptr(), b.data_ptr(), y.data_ptr(), a.numel(), torch.get_num_threads())
    return y
