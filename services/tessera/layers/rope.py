"""Rotary position embedding (the non-interleaved "rotate half" form used by HF Llama).

q' = q * cos(p * f) + rotate_half(q) * sin(p * f), with f_i = theta^(-2i / d) and
rotate_half([x1, x2]) = [-x2, x1]. The tables are computed once in float32 for every position
up to max_positions, the sine with the sign of rotate_half folded in ([-sin, sin]), so that
rotate_half(x) * sin = swap_halves(x) * signed_sin: the same products, in four torch ops for
q and k together (a decode step at batch 1 is short enough for per-op overhead to show).
"""
from __future__ import annotations

import torch
from torch import nn

from tessera_kernels import elementwise_cpu


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        signed_sin = emb.sin()
        signed_sin[:, :head_dim // 2].neg_()
        self.register_buffer("sin", signed_sin, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for these positions as [T, 1, D]; looked up once per step, used by
        every layer."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] (query and key heads side by side) rotated by the per-token angles.
    bf16 and float32 on the CPU are rotated in place by one C pass (bf16: the same roundings);
    callers use the result, never x afterwards."""
    D = x.shape[-1]
    if (D % 32 == 0 and x.stride(1) == D and not x.requires_grad and cos.dtype == x.dtype
            and cos.is_contiguous() and sin.is_contiguous() and elementwise_cpu.applies(x, D)):
        return elementwise_cpu.rope_(x, cos, sin)
    return x * cos + x.roll(D // 2, dims=-1) * sin
