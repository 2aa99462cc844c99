"""GGUF metadata -> the config.json that Hugging Face would hold for the same model, so that
ModelConfig.from_hf parses both kinds of checkpoint. The keys are the ones llama.cpp's
converter (convert_hf_to_gguf.py) writes; where it drops a number, the value is the one
llama.cpp itself assumes when it runs the file (Gemma's query scale and layer pattern)."""
from __future__ import annotations

import math

import numpy as np

from tessera.config import ConfigError

# general.architecture -> (HF architecture, HF model_type)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),     # Mistral too: the converter writes it as llama
    "granite": ("GraniteForCausalLM", "granite"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "olmo2": ("Olmo2ForCausalLM", "olmo2"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
# llama.cpp's fixed layer patterns (every n-th layer is full attention) and Gemma 3's
# sliding-layer RoPE base, for files that do not state them
_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA3_LOCAL_THETA = 10000.0
_ROPE_FREQS = "rope_freqs.weight"
_LONGROPE = ("rope_factors_long.weight", "rope_factors_short.weight")   # Phi-3's LongRoPE


def hf_config(meta: dict, tensors: dict) -> dict:
    """config.json for a GGUF's metadata; tensors: name -> GGUFTensor (shapes, rope_freqs)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    g = lambda key, default=None: _decimal(meta.get(f"{arch}.{key}", default))  # noqa: E731
    heads, hidden, layers = int(g("attention.head_count")), int(g("embedding_length")), int(g("block_count"))
    head_dim = int(g("attention.key_length") or g("rope.dimension_count") or hidden // heads)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    hf_arch, model_type = ARCHITECTURES[arch]
    cfg = dict(
        architectures=[hf_arch], model_type=model_type,
        vocab_size=int(tensors["token_embd.weight"].shape[0]), hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=int(g("attention.head_count_kv") or heads),
        head_dim=head_dim, rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(g("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        attention_bias="blk.0.attn_output.bias" in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=int(eos) if eos is not None else None,
        rope_parameters=_rope(g, head_dim, tensors),
    )
    if g("attention.sliding_window"):
        cfg["sliding_window"] = int(g("attention.sliding_window"))
    if arch == "granite":
        cfg.update(embedding_multiplier=g("embedding_scale", 1.0), residual_multiplier=g("residual_scale", 1.0),
                   attention_multiplier=g("attention.scale"), logits_scaling=g("logit_scale", 1.0))
    if arch in ("gemma2", "gemma3"):
        cfg.update(_gemma(arch, g, cfg))
    return cfg


def _decimal(value):
    """A float32 from the file as the shortest decimal that rounds to it (1e-05, not
    9.99999974e-06): the value config.json held before conversion."""
    return float(str(np.float32(value))) if isinstance(value, float) else value


def _rope(g, head_dim: int, tensors: dict) -> dict:
    """rope_parameters: linear and YaRN from rope.scaling.*; Llama 3's from rope_freqs, the
    per-frequency divisors that the converter writes instead of metadata."""
    rope = {"rope_type": "default", "rope_theta": float(g("rope.freq_base", 10000.0))}
    kind = g("rope.scaling.type", "none")
    if kind == "linear" and g("rope.scaling.factor", 1.0) != 1.0:
        rope.update(rope_type="linear", factor=float(g("rope.scaling.factor")))
    elif kind == "yarn":
        rope.update(rope_type="yarn", factor=float(g("rope.scaling.factor")),
                    original_max_position_embeddings=int(g("rope.scaling.original_context_length")))
        for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                        ("yarn_attn_factor", "attention_factor")):
            if g(f"rope.scaling.{key}") is not None:
                rope[hf] = float(g(f"rope.scaling.{key}"))
    elif kind not in ("none", "linear"):
        raise ConfigError(f"GGUF rope scaling {kind!r} is not supported (supported: none, linear, yarn)")
    if _ROPE_FREQS in tensors:
        from tessera.models.gguf_file import dequantize
        factors = np.array(dequantize(tensors[_ROPE_FREQS]), dtype=np.float64).reshape(-1)
        rope.update(llama3_rope(factors, rope["rope_theta"], head_dim))
    if _LONGROPE[0] in tensors:
        rope.update(_longrope(g, tensors))
    return rope


def _longrope(g, tensors: dict) -> dict:
    """Phi-3's per-frequency long and short factors, stored as tensors; the attention factor is
    kept only where it differs from the one transformers derives from the two lengths."""
    from tessera.models.gguf_file import dequantize
    if _LONGROPE[1] not in tensors:
        raise ConfigError(f"GGUF has {_LONGROPE[0]} without {_LONGROPE[1]}")
    long, short = (np.array(dequantize(tensors[n]), dtype=np.float32).reshape(-1) for n in _LONGROPE)
    original = int(g("rope.scaling.original_context_length"))
    rope = dict(rope_type="longrope", long_factor=[_decimal(float(x)) for x in long],
                short_factor=[_decimal(float(x)) for x in short], original_max_position_embeddings=original)
    scale = int(g("context_length")) / original
    derived = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    given = g("rope.scaling.attn_factor")
    if given is not None and abs(given - derived) > 1e-6 * derived:
        rope["attention_factor"] = float(given)
    return rope


def llama3_rope(factors: np.ndarray, theta: float, head_dim: int) -> dict:
    """Llama 3 rope parameters that give these divisors (1 for short wavelengths, `factor` for
    long ones, 1 / ((1 - s) / factor + s) between, s linear in 1 / wavelength). Only the ratios
    original / low_freq_factor and original / high_freq_factor matter, so low_freq_factor is
    taken as 1; with one frequency in the band high_freq_factor is the converter's default 4,
    with none it puts the boundary just past the last kept wavelength. Checked against the file."""
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    factor = float(factors.max())
    if factor <= 1.0 or len(factors) != head_dim // 2:
        raise ConfigError(f"GGUF rope_freqs {factors.tolist()} is not Llama 3 rope scaling")
    band = (factors > 1.0 + 1e-6) & (factors < factor * (1 - 1e-6))
    smooth = (1 / factors[band] - 1 / factor) / (1 - 1 / factor)     # s = original / w - low, scaled
    if band.sum() >= 2:
        slope, intercept = np.polyfit(1 / wavelen[band], smooth, 1)   # s = slope / w + intercept
        low, high, original = -intercept, 1 - intercept, slope        # high - low = 1
        if low > 1e-9:
            low, high, original = 1.0, high / low, original / low
    elif band.sum() == 1:
        low, high = 1.0, 4.0
        original = wavelen[band][0] * (smooth[0] * (high - low) + low)
    else:   # a step: the first stretched wavelength is original / low, the last kept one just below original / high
        low, original = 1.0, float(wavelen[factors >= factor * (1 - 1e-6)].min())
        kept = wavelen[factors <= 1.0 + 1e-6]
        high = original / kept.max() * (1 - 1e-6) if len(kept) else 4.0
    if abs(original - round(original)) < 1e-3 * original:
        original = round(original)       # a context length: an integer up to the fit's rounding
    high = float(f"{high:.6g}")          # 4.0, not 3.9999994: the fit's float32 rounding
    rope = dict(rope_type="llama3", factor=factor, low_freq_factor=float(low), high_freq_factor=float(high),
                original_max_position_embeddings=original)
    _check_llama3(rope, factors, theta, head_dim)
    return rope


def _check_llama3(rope: dict, factors: np.ndarray, theta: float, head_dim: int) -> None:
    from tessera.layers.rope import rope_frequencies
    plain, _ = rope_frequencies(head_dim, theta, {})
    scaled, _ = rope_frequencies(head_dim, theta, rope)
    ours = (plain.double() / scaled.double()).numpy()
    if not np.allclose(ours, factors, rtol=1e-4):
        raise ConfigError(f"GGUF rope_freqs {factors.tolist()} is not Llama 3 rope scaling")


def _gemma(arch: str, g, cfg: dict) -> dict:
    """The converter writes no query scale and no layer pattern for Gemma; llama.cpp scales
    queries by head_dim ** -0.5 (by (hidden / heads) ** -0.5 for the 27B models, which it
    recognizes by their layer count) and fixes the pattern per architecture."""
    layers, head_dim = cfg["num_hidden_layers"], cfg["head_dim"]
    scale = g("attention.scale")
    big = layers == {"gemma2": 46, "gemma3": 62}[arch]
    scalar = scale ** -2 if scale else cfg["hidden_size"] / cfg["num_attention_heads"] if big else head_dim
    pattern = g("attention.sliding_window_pattern", _SWA_PATTERN[arch])
    if isinstance(pattern, list):     # per layer: True where the layer slides
        types = ["sliding_attention" if swa else "full_attention" for swa in pattern]
    else:
        types = ["sliding_attention" if (l + 1) % pattern else "full_attention" for l in range(layers)]
    out = dict(query_pre_attn_scalar=scalar, layer_types=types,
               attn_logit_softcapping=g("attn_logit_softcapping"),
               final_logit_softcapping=g("final_logit_softcapping"))
    if arch == "gemma3":
        local = {"rope_type": "default", "rope_theta": float(g("rope.freq_base_swa", _GEMMA3_LOCAL_THETA))}
        out["rope_parameters"] = {"full_attention": cfg["rope_parameters"], "sliding_attention": local}
    return out
