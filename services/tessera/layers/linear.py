"""The dense linear layer of every model: nn.Linear, with the CPU's faster paths.

- A bf16 product of one to four rows (decode at a small batch, where each weight is read
  once per token) goes to the kernel that streams the weights at the memory's speed
  (tessera_kernels.gemv_cpu). It may differ from torch in the last bit (summation order).
- A bf16 product of 5 rows or more, where the CPU has AMX, goes to the AMX tile kernel
  (tessera_kernels.amx_linear): faster than oneDNN up to 32 rows (where its results equal
  oneDNN's bit for bit), about as fast at 33-64 and faster again for prompt chunks of
  128-2048 rows; unlike oneDNN's, its calls can be replayed (step_graph.py). Above 32 rows
  one element in 10^4 differs in the last bit.
- A bf16 product of 5 or more rows where the CPU has no AMX but AVX512-BF16 (AMD Zen 4 and
  Zen 5; Intel without AMX, where the same tiles run as float32 FMAs), or AVX-512 or AVX2 with
  FMA (Intel Cascade Lake, AMD Zen 3: float32 FMAs over bf16 weights), and a float32 product
  of any size where it has AVX2 and FMA, go to the register-tile
  kernels (tessera_kernels.tile_linear): oneDNN leaves part of the vector units idle there.
  Their results differ from oneDNN's in the last bit in about one
  element in 10^4. Either packed kernel's copy of the weight is made on first use.
- Any other product (float32 where the register tiles are not built,
  shapes they do not take) goes to oneDNN with the weight reordered once into its blocked layout
  (the reorder inductor's weight freezing does), instead of torch's F.linear, which repacks
  the weight on every call, which costs a large share of a small product's time.
  The bf16 result is bitwise F.linear's. The blocked copy is made on first use and kept
  beside the weight (made again if the weight changes); autograd never takes this path.

In the batch-invariant mode (set_batch_invariant) every product of any row count goes to the
register tiles, AMX CPUs included, whose rows do not change with the rows beside them; a shape
they do not take is computed a row at a time (slow, and the same bits in any batch).
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from tessera_kernels import amx_linear, gemv_cpu, replay, tile_linear

# Kernels that take the weight packed in their own layout: for a dtype at most one applies on
# a CPU (bf16: the AMX one where it has AMX, else the register tiles where it has AVX-512 or
# AVX2 with FMA).
_PACKED_KERNELS = (amx_linear, tile_linear)


class Linear(nn.Linear):
    _blocked: torch.Tensor | None = None
    _blocked_of: tuple = ()
    _packed: torch.Tensor | None = None
    _packed_of: tuple = ()
    batch_invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant and not self._needs_autograd(x):
            return self._invariant(x)
        if x.dim() == 2 and gemv_cpu.applies(x, self.weight):
            return gemv_cpu.gemv_bf16(x, self.weight, self.bias)
        kernel = next((k for k in _PACKED_KERNELS if k.applies(x, self.weight)), None)
        if kernel is not None and not self._needs_autograd(x):
            key = (kernel.__name__, *self._weight_key())
            if self._packed is None or self._packed_of != key:
                with replay.paused():   # made once: a step being recorded (step_graph.py) only reads it
                    self._packed, self._packed_of = kernel.pack(self.weight.detach()), key
            return kernel.linear(x, self._packed, self.bias, self.weight.shape[0])
        blocked = self._blocked_weight(x)
        if blocked is not None:
            return torch.ops.mkldnn._linear_pointwise(x, blocked, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def _invariant(self, x: torch.Tensor) -> torch.Tensor:
        """The product with each row's bits independent of the other rows (module docstring)."""
        rows = x.reshape(-1, x.shape[-1])
        if tile_linear.applies(rows, self.weight, every_row_count=True):
            key = ("invariant", *self._weight_key())
            if self._packed is None or self._packed_of != key:
                with replay.paused():
                    self._packed, self._packed_of = tile_linear.pack(self.weight.detach()), key
            out = tile_linear.linear(rows, self._packed, self.bias, self.weight.shape[0])
        else:
            out = torch.cat([F.linear(rows[i:i + 1], self.weight, self.bias) for i in range(rows.shape[0])]) \
                if rows.shape[0] else F.linear(rows, self.weight, self.bias)
        return out.reshape(*x.shape[:-1], self.weight.shape[0])

    def _blocked_weight(self, x: torch.Tensor) -> torch.Tensor | None:
        """oneDNN's copy of the weight, or None where that path does not apply (autograd,
        another device or dtype, a CPU without oneDNN bf16)."""
        w = self.weight
        if x.dtype != w.dtype or not onednn_supports(w.dtype) or w.device.type != "cpu" or self._needs_autograd(x):
            return None
        key = self._weight_key()
        if self._blocked is None or self._blocked_of != key:
            self._blocked = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
            self._blocked_of = key
        return self._blocked

    def _needs_autograd(self, x: torch.Tensor) -> bool:
        """Whether this product must be recorded for backward (the kernels are not)."""
        return torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad
                                            or (self.bias is not None and self.bias.requires_grad))

    def _weight_key(self) -> tuple:
        """Changes when the weight is replaced, or edited in place (an inference tensor keeps
        no version count): the derived copies are made again."""
        w = self.weight
        return w.data_ptr(), 0 if w.is_inference() else w._version, w.dtype, tuple(w.shape), w.stride()

    def __getstate__(self) -> dict:
        """Copies and pickles leave the derived weights behind (oneDNN's opaque tensor has no
        storage to copy); the copy makes its own on first use."""
        state = super().__getstate__()
        for name in ("_blocked", "_blocked_of", "_packed", "_packed_of"):
            state.pop(name, None)
        return state


def set_batch_invariant(model: nn.Module, on: bool) -> None:
    """Every Linear of the model in the batch-invariant mode, or back out of it."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.batch_invariant = on


@functools.cache
def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs this dtype's linears here (bf16 needs AVX-512 or AVX2-VNNI class
    hardware). TESSERA_DISABLE_ONEDNN=1 turns this path off (to compare the paths), and so
    does TESSERA_DISABLE_CPU_KERNELS=1, which turns off the C kernels too."""
    if "1" in (os.environ.get("TESSERA_DISABLE_ONEDNN"), os.environ.get("TESSERA_DISABLE_CPU_KERNELS")) or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
