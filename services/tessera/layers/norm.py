"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, computed in float32 as transformers does;
Gemma's stores the weight as w - 1: y = x / sqrt(mean(x^2) + eps) * (1 + w)."""
from __future__ import annotations

import torch
from torch import nn

from tessera_kernels import elementwise_cpu


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dim() == 2 and self.weight.dtype == x.dtype and not self.weight.requires_grad
                and not x.requires_grad and elementwise_cpu.applies(x, x.shape[-1])):
            return elementwise_cpu.rms_norm(x, self.weight, self.eps)   # one pass (bf16: the same roundings)
        if x.dtype == torch.float32:
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return rms_norm_low_precision(x, self.weight, self.eps)


def rms_norm_low_precision(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Statistics in float32, the normalized x rounded to x's dtype before the weight, as HF does."""
    normed = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * normed.to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * (1 + w), all in float32, rounded to x's dtype once at
    the end (Gemma's order: Llama's rounds before the weight)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)
