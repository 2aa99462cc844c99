"""The dense linear layer of every model: nn.Linear, except that a bf16 product of one to four
rows (decode at a small batch, where each weight is read once per token) goes to the CPU
kernel that streams the weights at the memory's speed (tessera_kernels.gemv_cpu); any other
product is torch's. Both accumulate in float32 and round to bf16 once; they may differ in
the last bit of a bf16 output (summation order)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera_kernels import gemv_cpu


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and gemv_cpu.applies(x, self.weight):
            return gemv_cpu.gemv_bf16(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
