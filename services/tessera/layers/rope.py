"""Rotary position embedding (the non-interleaved "rotate half" form used by HF Llama).

q' = q * cos(p * f) + rotate_half(q) * sin(p * f), with f_i = theta^(-2i / d) and
rotate_half([x1, x2]) = [-x2, x1]. The tables are computed once in float32 for every position
up to max_positions, the sine with the sign of rotate_half folded in ([-sin, sin]), so that
rotate_half(x) * sin = swap_halves(x) * signed_sin: the same products, in four torch ops for
q and k together (a decode step at batch 1 is short enough for per-op overhead to show).
Context extension (rope_scaling) changes only the frequencies f and, for YaRN, a factor on
cos and sin: rope_frequencies computes both as transformers does. Two kinds pick f from the
sequence's length s (docs/models.md): dynamic NTK (theta grows with s past the original
length) and LongRoPE (Phi-3: per-dimension short or long factors, long once s is past it).
transformers takes s as the longest position + 1 of each forward call; the rule here, the same
at any chunking and in tree verification, rotates the token at position p of a request whose
prompt has L tokens with s = max(p + 1, L): what a prefill of the prompt and then one decode
step per token give there.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from tessera_kernels import elementwise_cpu


LENGTH_DEPENDENT = ("dynamic", "longrope")   # rope types whose f depend on the sequence length


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        scaling = scaling or {}
        self.kind = scaling.get("rope_type", "default")
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        # cos/sin: every position with f (dynamic: f for s up to the original length, past it
        # computed per s; LongRoPE: the long factors); short_cos/short_sin: LongRoPE's short
        # factors, for the positions below the original length
        self.original = int(scaling.get("original_max_position_embeddings", 0))
        inv_freq, self.attention_factor = rope_frequencies(head_dim, theta, scaling)
        tables = {"cos": None, "sin": None, "short_cos": None, "short_sin": None}
        tables["cos"], tables["sin"] = _tables(inv_freq, max_positions, self.attention_factor)
        if self.kind == "longrope":
            short, _ = rope_frequencies(head_dim, theta, scaling, long=False)
            tables["short_cos"], tables["short_sin"] = _tables(short, self.original, self.attention_factor)
        for name, table in tables.items():
            self.register_buffer(name, table, persistent=False)
        self._dynamic: dict[int, torch.Tensor] = {}   # s -> dynamic NTK frequencies, made on first need

    def forward(self, positions: torch.Tensor, dtype: torch.dtype,
                prompt_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for these positions as [T, 1, D]; looked up once per step, used by
        every layer. prompt_lens [T]: each token's request's prompt length, for the rope types
        that depend on it (None: s = p + 1)."""
        if self.kind not in LENGTH_DEPENDENT:
            return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]
        s = positions + 1 if prompt_lens is None else torch.maximum(positions + 1, prompt_lens)
        past = s > self.original
        if self.kind == "longrope":
            near = positions.clamp(max=self.original - 1)
            cos = torch.where(past[:, None], self.cos[positions], self.short_cos[near])
            sin = torch.where(past[:, None], self.sin[positions], self.short_sin[near])
        else:
            cos, sin = self.cos[positions], self.sin[positions]
            if past.any():
                idx = past.nonzero()[:, 0]
                inv_freq = torch.stack([self._dynamic_frequencies(n) for n in s[idx].tolist()])
                cos[idx], sin[idx] = _angles(positions[idx, None].float() * inv_freq, 1.0)
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def _dynamic_frequencies(self, seq_len: int) -> torch.Tensor:
        """Dynamic NTK's f at sequence length s > original, computed as transformers does once
        s passes it (with s a tensor: float32 throughout), so that the bits are the same."""
        f = self._dynamic.get(seq_len)
        if f is None:
            factor, d = float(self.scaling["factor"]), self.head_dim
            n = torch.maximum(torch.tensor(seq_len), torch.tensor(self.original))
            base = self.theta * ((factor * n / self.original) - (factor - 1)) ** (d / (d - 2))
            f = self._dynamic[seq_len] = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        return f


def _angles(freqs: torch.Tensor, attention_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [N, D] of angles [N, D / 2]."""
    emb = torch.cat((freqs, freqs), dim=-1)
    signed_sin = emb.sin() * attention_factor
    signed_sin[:, :freqs.shape[-1]].neg_()
    return emb.cos() * attention_factor, signed_sin


def _tables(inv_freq: torch.Tensor, positions: int, attention_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [positions, D] of positions 0, 1, ... in float32."""
    return _angles(torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None, :], attention_factor)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] (query and key heads side by side) rotated by the per-token angles.
    bf16 and float32 on the CPU are rotated in place by one C pass (bf16: the same roundings);
    callers use the result, never x afterwards."""
    D = x.shape[-1]
    if (D % 32 == 0 and x.stride(1) == D and not x.requires_grad and cos.dtype == x.dtype
            and cos.is_contiguous() and sin.is_contiguous() and elementwise_cpu.applies(x, D)):
        return elementwise_cpu.rope_(x, cos, sin)
    return x * cos + x.roll(D // 2, dims=-1) * sin


def rope_frequencies(head_dim: int, theta: float, scaling: dict, long: bool = True) -> tuple[torch.Tensor, float]:
    """(f [head_dim / 2], factor on cos and sin) for rope_scaling as config.json writes it
    (ModelConfig's items). Dynamic NTK: f up to the original length, the theta itself;
    LongRoPE: f with the long factors (long=False: the short ones)."""
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
    if kind == "dynamic":            # transformers' formula at s = original: theta * 1 ** (d / (d - 2))
        base = theta * ((factor * scaling["original_max_position_embeddings"]
                         / scaling["original_max_position_embeddings"]) - (factor - 1)) ** (head_dim / (head_dim - 2))
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)), 1.0
    if kind == "longrope":
        return _longrope(head_dim, theta, factor, scaling, long)
    raise ValueError(f"rope type {kind!r} has no frequencies here")


def _longrope(dim: int, base: float, factor: float, s: dict, long: bool) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): f_i = 1 / (factor_i * theta^(2i / d)), factor_i from long_factor or
    short_factor; cos and sin scaled by sqrt(1 + ln(factor) / ln(original)) unless the
    checkpoint gives attention_factor."""
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        original = s["original_max_position_embeddings"]
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(s["long_factor"] if long else s["short_factor"], dtype=torch.float32)
    return 1.0 / (ext * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), float(attention_factor)


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
