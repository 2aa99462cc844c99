"""ModelConfig: the architecture numbers every model file needs, parsed from an HF config.json
or from GGUF metadata, so that both kinds of checkpoint build the same modules."""
from __future__ import annotations

from dataclasses import dataclass

from tessera.config import ConfigError

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "GraniteForCausalLM": "llama",
    "Phi3ForCausalLM": "llama",
    "Olmo2ForCausalLM": "olmo2",
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen_moe",
    "Qwen3MoeForCausalLM": "qwen_moe",
}

# rope types layers/rope.py computes. "dynamic" and "longrope" depend on the sequence length
# (transformers: of each forward call; here: of the token's request, see layers/rope.py).
SCALED_ROPE_TYPES = ("linear", "llama3", "yarn", "dynamic", "longrope")
LENGTH_DEPENDENT = ("dynamic", "longrope")   # as layers/rope.py's, named here without importing torch


@dataclass(frozen=True)
class ModelConfig:
    arch: str                     # "llama", "olmo2", "gemma", "mixtral" or "qwen_moe": the model file
    model_type: str               # the HF model_type, e.g. "llama", "qwen2", "qwen3_moe"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, object], ...] = ()   # config.json's rope_scaling items (see layers/rope.py)
    local_rope_theta: float = 0.0   # Gemma 3: the sliding-window layers' own RoPE base (0: rope_theta)
    layer_windows: tuple[int, ...] = ()   # per layer: sliding window in tokens (0: full); (): none windowed
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    # Granite's constants (1.0 / None elsewhere): embeddings, sublayer outputs and logits are
    # multiplied / divided by them; query_scale replaces head_dim ** -0.5.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    query_scale: float | None = None
    # soft-capping (Gemma 2; 0: none): scores = c * tanh(scores / c) in attention, likewise logits
    attn_softcap: float = 0.0
    final_logit_softcap: float = 0.0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @property
    def rope_depends_on_prompt(self) -> bool:
        """Whether a token's rotation depends on its request's prompt length (then the KV of
        one prompt's tokens is not another's: no prefix caching)."""
        return dict(self.rope_scaling).get("rope_type") in LENGTH_DEPENDENT

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window: a query at position p sees keys k with p - k < window."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def is_moe_layer(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(f"unsupported architectures {archs}; supported: {sorted(ARCHITECTURES)}")
        if cfg.get("auto_map"):
            raise ConfigError(f"the checkpoint needs its own code (auto_map {sorted(cfg['auto_map'])}); "
                              "Tessera runs only the architectures it implements: " + ", ".join(sorted(ARCHITECTURES)))
        cfg, local_theta = _split_rope_by_layer_type(cfg)
        rope = cfg.get("rope_parameters") or {}
        if rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ConfigError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        model_type = cfg.get("model_type", arch)
        return cls(
            arch=arch,
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size", 0),
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling(cfg),
            local_rope_theta=local_theta,
            layer_windows=_layer_windows(cfg),
            max_position_embeddings=_max_positions(cfg),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=bool(cfg.get("qkv_bias", cfg.get("attention_bias", False))
                          or model_type in ("qwen2", "qwen2_moe")),
            o_bias=bool(cfg.get("attention_bias", False)) and model_type not in ("qwen2", "qwen2_moe"),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
            logits_scaling=float(cfg.get("logits_scaling", 1.0)),
            query_scale=_query_scale(cfg),
            attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0),
            final_logit_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
            num_experts=cfg.get("num_local_experts", cfg.get("num_experts", 0)) or 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0) or 0,
            moe_intermediate_size=cfg.get("moe_intermediate_size") or cfg.get("intermediate_size", 0),
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0) or 0,
            norm_topk_prob=cfg.get("norm_topk_prob", arch == "mixtral"),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        )


def _split_rope_by_layer_type(cfg: dict) -> tuple[dict, float]:
    """Gemma 3 gives full and sliding layers each their RoPE (rope_parameters keyed by layer
    type in transformers 5, rope_local_base_freq before): (cfg with the full layers' as its
    rope_parameters, the sliding layers' base; 0.0 where there is none)."""
    rope = cfg.get("rope_parameters") or {}
    if "full_attention" not in rope:
        return cfg, float(cfg.get("rope_local_base_freq") or 0.0)
    local = rope.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ConfigError(f"rope type {local['rope_type']!r} on the sliding-window layers is not supported")
    return dict(cfg, rope_parameters=rope["full_attention"]), float(local.get("rope_theta") or 0.0)


def _rope_scaling(cfg: dict) -> tuple[tuple[str, object], ...]:
    """rope_scaling (transformers 4) or rope_parameters (5) as hashable items; () for plain RoPE."""
    scaling = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    scaling.pop("rope_theta", None)
    scaling.pop("partial_rotary_factor", None)     # anything but 1.0 is refused in from_hf
    if kind in ("default", None):
        return ()
    kind = "longrope" if kind == "su" else kind     # LongRoPE's first name (Phi-3 128k's early configs)
    if kind not in SCALED_ROPE_TYPES:
        raise ConfigError(f"rope type {kind!r} is not supported (supported: default, {', '.join(SCALED_ROPE_TYPES)})")
    if kind == "dynamic":       # transformers: the original length is max_position_embeddings itself
        scaling["original_max_position_embeddings"] = cfg.get("max_position_embeddings", 4096)
    elif kind == "longrope":    # Phi-3 writes it beside rope_scaling; that one wins, as in transformers
        scaling["original_max_position_embeddings"] = cfg.get(
            "original_max_position_embeddings",
            scaling.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 4096)))
    if scaling.get("factor") is None and "original_max_position_embeddings" in scaling:
        scaling["factor"] = cfg["max_position_embeddings"] / scaling["original_max_position_embeddings"]
    return (("rope_type", kind),) + tuple(
        (k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(scaling.items()))


def _max_positions(cfg: dict) -> int:
    """The longest sequence: max_position_embeddings, which dynamic NTK scaling extends by its
    factor (its frequencies adapt past max_position_embeddings, the length trained on)."""
    n = cfg.get("max_position_embeddings", 4096)
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type")) == "dynamic":
        return int(n * float(rope["factor"]))
    return n


def _layer_windows(cfg: dict) -> tuple[int, ...]:
    """Which layers slide and by how much: layer_types when config.json lists them (transformers
    5 writes them for Qwen2/3, Gemma); else Gemma's fixed pattern, Mistral's/Mixtral's/Phi-3's
    sliding_window on every layer, or Qwen2's use_sliding_window from max_window_layers on."""
    window, n = cfg.get("sliding_window") or 0, cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    pattern = {"gemma2": 2, "gemma3_text": cfg.get("sliding_window_pattern", 6)}.get(cfg.get("model_type"))
    if not types and pattern:   # written before layer_types: every pattern-th layer is full
        types = ["sliding_attention" if (l + 1) % pattern else "full_attention" for l in range(n)]
    if types:
        windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    elif not window or cfg.get("use_sliding_window") is False:
        return ()
    else:
        start = cfg.get("max_window_layers", 0) if "use_sliding_window" in cfg else 0
        windows = tuple(window if l >= start else 0 for l in range(n))
    return windows if any(windows) else ()


def _query_scale(cfg: dict) -> float | None:
    """Granite's attention_multiplier, Gemma's query_pre_attn_scalar ** -0.5; None: head_dim ** -0.5."""
    if cfg.get("attention_multiplier") is not None:
        return float(cfg["attention_multiplier"])
    if cfg.get("query_pre_attn_scalar") is not None:
        return float(cfg["query_pre_attn_scalar"]) ** -0.5
    return None
