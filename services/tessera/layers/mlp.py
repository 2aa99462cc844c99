"""SwiGLU MLP, the dense FFN of the Llama family (GeGLU: Gemma's); an expert node may hold a column
range of it."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.layers.linear import Linear
from tessera_kernels import elementwise_cpu


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for rows [gate | up]; bf16 and float32 rows on the CPU in one
    C pass (bf16: the same roundings)."""
    if gate_up.dim() == 2 and not gate_up.requires_grad and elementwise_cpu.applies(gate_up, gate_up.shape[-1] // 2):
        return elementwise_cpu.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False, device=device)
        self.down_proj = Linear(intermediate, hidden, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))

    def columns(self, i0: int, i1: int) -> "SwiGLU":
        """A new SwiGLU of intermediate columns [i0, i1) (weights copied): the MLP is a sum over
        its intermediate columns, so the outputs of disjoint column ranges add up to this one's."""
        inter = self.down_proj.weight.shape[1]
        if not 0 <= i0 <= i1 <= inter:
            raise ValueError(f"columns [{i0}, {i1}) outside the MLP's {inter}")
        w = self.gate_up_proj.weight.data
        part = type(self)(w.shape[1], i1 - i0, device="meta")   # meta: no memory until the weights below
        part.gate_up_proj.weight = nn.Parameter(torch.cat([w[i0:i1], w[inter + i0:inter + i1]]),
                                                requires_grad=False)
        part.down_proj.weight = nn.Parameter(self.down_proj.weight.data[:, i0:i1].contiguous(),
                                             requires_grad=False)
        return part


class GeGLU(SwiGLU):
    """down(gelu_tanh(gate(x)) * up(x)): Gemma's activation, the same fused weights."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)
