"""Rotary position embedding (the non-interleaved "rotate half" form used by HF Llama).

q' = q * cos(p * f) + rotate_half(q) * sin(p * f), with f_i = theta^(-2i / d) and
rotate_half([x1, x2]) = [-x2, x1]. The tables are computed once in float32 for every position
up to max_positions, the sine with the sign of rotate_half folded in ([-sin, sin]), so that
rotate_half(x) * sin = swap_halves(x) * signed_sin: the same products, in four torch ops for
q and k together (a decode step at batch 1 is short enough for per-op overhead to show).
Context extension (rope_scaling) changes only the frequencies f and, for YaRN, a factor on
cos and sin: rope_frequencies computes both as transformers does.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from tessera_kernels import elementwise_cpu


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        inv_freq, attention_factor = rope_frequencies(head_dim, theta, scaling or {})
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * attention_factor, persistent=False)
        signed_sin = emb.sin() * attention_factor
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


def rope_frequencies(head_dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """(f [head_dim / 2], factor on cos and sin) for rope_scaling as config.json writes it."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if kind == "linear":             # positions divided by factor
        return inv_freq / factor, 1.0
    if kind == "llama3":
        return _llama3(inv_freq, factor, scaling), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, factor, scaling)
    raise ValueError(f"rope type {kind!r} has no frequencies here")


def _llama3(inv_freq: torch.Tensor, factor: float, s: dict) -> torch.Tensor:
    """Llama 3.1: wavelengths longer than original/low_freq_factor are stretched by factor,
    shorter than original/high_freq_factor kept, and the band between blended linearly."""
    old, low, high = s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)
    return torch.where(medium, blended, scaled)


def _yarn(dim: int, base: float, factor: float, s: dict) -> tuple[torch.Tensor, float]:
    """YaRN: dimensions that turn fewer than beta_slow times over the original context are
    interpolated (f / factor), more than beta_fast times kept, a linear ramp between; cos and
    sin are scaled by 0.1 * ln(factor) + 1 (or the checkpoint's attention_factor / mscales)."""
    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention_factor = mscale(m) / mscale(m_all) if m and m_all else mscale()
    original = s["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)
