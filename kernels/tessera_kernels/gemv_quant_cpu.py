"""Weight-only int4 and int8 linears for a few rows (decode at small batch): the packing, a
torch reference and a C kernel (csrc/gemv_quant.c) that widens the codes in registers.

torch's packed int4 kernel (aten._weight_int4pack_mm_for_cpu) reads its quarter of the bytes slower
than our bf16 GEMV reads all of them, and its packed layout depends on the CPU's vector width, so
the codes here are packed our own way: the columns in runs of 32, the runs in pairs, byte j of a
pair holding column j of the first run in its low nibble and column j of the second in its high one
(one 32-byte load, two runs in the order of x).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from tessera_kernels import cbuild

RUN = 32   # columns per packed run; int4 groups are whole runs
ROWS_PER_PASS = 4   # csrc/gemv_quant.c's ROWS: the weights are read once per pass of up to 4 rows


def pack_q4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] (values 0..15, K a multiple of 32) -> packed [N, 32 * ceil(K / 64)]
    uint8 (an odd last run is paired with zeros)."""
    n, k = codes.shape
    runs = codes.to(torch.uint8).view(n, k // RUN, RUN)
    if runs.shape[1] % 2:
        runs = torch.cat([runs, torch.zeros(n, 1, RUN, dtype=torch.uint8)], dim=1)
    pairs = runs.view(n, -1, 2, RUN)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, -1).contiguous()


def unpack_q4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of pack_q4: codes [N, K] uint8."""
    n = packed.shape[0]
    p = packed.view(n, -1, RUN)
    return torch.stack([p & 0x0F, p >> 4], dim=2).reshape(n, -1)[:, :k]


def packed_q4_shape(n: int, k: int) -> tuple[int, int]:
    return n, RUN * -(-k // (2 * RUN))


def dequantize_q4(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, k: int) -> torch.Tensor:
    """w = q * scale + offset per group, float32 [N, K] (the reference and the fallback)."""
    q = unpack_q4(packed, k).float()
    n = q.shape[0]
    ng = scale.shape[1]
    w = q.view(n, ng, k // ng) * scale.float()[..., None] + offset.float()[..., None]
    return w.view(n, k)


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cbuild.load("gemv_quant")
    if lib is not None:
        lib.gemv_q4.restype = ctypes.c_int
        lib.gemv_q4.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 5
        lib.dequantize_q4.restype = ctypes.c_int
        lib.dequantize_q4.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
        lib.gemv_q8.restype = ctypes.c_int
        lib.gemv_q8.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    return lib


def available() -> bool:
    return _library() is not None


def _check(status: int, what: str) -> None:
    if status == -1:
        raise MemoryError(f"{what}: out of memory for the widened rows")
    if status:
        raise ValueError(f"{what}: the kernel refused the shapes (status {status})")


class Q4Weight:
    """An int4 weight (pack_q4's codes, bf16 scale and offset [N, K/G]) checked once, so a
    decode step's hundred-odd calls pay only for checking x (the kernels trust their shapes).
    The C kernels run only on CPU tensors (`on_cpu`); elsewhere dequantize() is torch's."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, in_features: int) -> None:
        K = in_features
        if scale.dim() != 2 or K <= 0 or scale.shape[1] <= 0 or K % scale.shape[1]:
            raise ValueError(f"int4 scales {tuple(scale.shape)} do not split {K} inputs into groups")
        N, ng = scale.shape
        if (K // ng) % RUN or packed.dtype != torch.uint8 or packed.shape != packed_q4_shape(N, K) \
                or not packed.is_contiguous():
            raise ValueError(f"int4 weight {tuple(packed.shape)} with {ng} groups does not fit {K} inputs")
        for t in (scale, offset):
            if t.dtype != torch.bfloat16 or not t.is_contiguous() or t.shape != (N, ng) or t.device != packed.device:
                raise ValueError(f"int4 scale and offset must be contiguous bfloat16 [{N}, {ng}] beside the codes")
        self.packed, self.scale, self.offset = packed, scale, offset
        self.out_features, self.in_features, self.group = N, K, K // ng
        self.on_cpu = packed.device.type == "cpu"

    def gemv(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] on the CPU -> x W^T [M, N] bf16 by the C kernel (callers check available())."""
        if x.dim() != 2 or x.shape[1] != self.in_features or x.device.type != "cpu" or not self.on_cpu:
            raise ValueError(f"int4 GEMV takes CPU inputs [M, {self.in_features}] and weights, not {tuple(x.shape)} "
                             f"on {x.device} with weights on {self.packed.device}")
        if x.dtype != torch.bfloat16 or not x.is_contiguous():
            x = x.to(torch.bfloat16).contiguous()
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.bfloat16)
        if x.shape[0]:
            _check(_library().gemv_q4(x.data_ptr(), self.packed.data_ptr(), self.scale.data_ptr(),
                                      self.offset.data_ptr(), y.data_ptr(), x.shape[0], self.out_features,
                                      self.in_features, self.group, torch.get_num_threads()), "int4 linear")
        return y

    def dequantize(self) -> torch.Tensor:
        """The dense bf16 weight [N, K] (on the weights' device): dequantize_q4 rounded to bf16,
        by the C kernel where it is built, on each call (nothing is cached: the point is memory)."""
        if _library() is None or not self.on_cpu:
            return dequantize_q4(self.packed, self.scale, self.offset, self.in_features).bfloat16()
        w = torch.empty(self.out_features, self.in_features, dtype=torch.bfloat16)
        _check(_library().dequantize_q4(self.packed.data_ptr(), self.scale.data_ptr(), self.offset.data_ptr(),
                                        w.data_ptr(), self.out_features, self.in_features, self.group,
                                        torch.get_num_threads()), "int4 dequantize")
        return w


def gemv_q8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] bf16, W = codes [N, K] int8 * scale [N] bf16 (callers check
    available())."""
    M, K = x.shape
    N = codes.shape[0]
    if codes.shape != (N, K) or K <= 0 or K % 16 or codes.dtype != torch.int8 or not codes.is_contiguous():
        raise ValueError(f"int8 weight {tuple(codes.shape)} does not fit x [{M}, {K}] (K a multiple of 16)")
    if scale.dtype != torch.bfloat16 or not scale.is_contiguous() or scale.shape != (N,):
        raise ValueError(f"int8 scale must be contiguous bfloat16 [{N}]")
    if not x.device.type == codes.device.type == scale.device.type == "cpu":
        raise ValueError("the int8 GEMV runs on CPU tensors only")
    if x.dtype != torch.bfloat16 or not x.is_contiguous():
        x = x.to(torch.bfloat16).contiguous()
    y = torch.empty(M, N, dtype=torch.bfloat16)
    if M:
        _check(_library().gemv_q8(x.data_ptr(), codes.data_ptr(), scale.data_ptr(), y.data_ptr(),
                                  M, N, K, torch.get_num_threads()), "int8 linear")
    return y
