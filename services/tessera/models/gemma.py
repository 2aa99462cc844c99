"""Gemma 2 and 3 (text): the Llama decoder with a norm before and after each sublayer
("sandwich"), norms that scale by (1 + w), embeddings scaled by sqrt(hidden), a GeGLU MLP;
Gemma 2 soft-caps scores and logits (model_config: attn_softcap, final_logit_softcap), Gemma 3
normalizes q and k per head and gives its sliding-window layers their own RoPE base
(local_rope_theta). query_pre_attn_scalar is the query scale; layer_types alternate
sliding-window and full layers:
    x   = embed(ids) * sqrt(hidden)
    h   = x + norm(attention(norm(x)))
    out = h + norm(geglu(norm(h)))
"""
from __future__ import annotations

import torch

from tessera.config import ConfigError
from tessera.layers.mlp import GeGLU
from tessera.layers.norm import GemmaRMSNorm
from tessera.layers.residual import residual_add
from tessera.layers.rope import RotaryEmbedding
from tessera.models.llama import CausalLM, FFNInput, LlamaAttention, LlamaFFN, Rule
from tessera.models.model_config import ModelConfig


class GemmaAttention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__(cfg, layer)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.qk_norm:
            self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        # with a local base, the model's tables are [full | local] side by side: take ours
        D = cfg.head_dim
        self.rope_columns = None if not cfg.local_rope_theta else slice(D, 2 * D) if self.window else slice(0, D)

    def forward(self, x, batch, kv, rope, masks=None) -> torch.Tensor:
        if self.rope_columns is not None:
            rope = tuple(t[..., self.rope_columns] for t in rope)
        return self.post_norm(self.attend(*self.project(x), batch, kv, rope, masks))


class GemmaFFN(LlamaFFN):
    """norm before the MLP (prepare), post_norm after it (finish, on the node that holds h)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GeGLU(cfg.hidden_size, cfg.intermediate_size)

    def finish(self, h: torch.Tensor, ffn_in: FFNInput, y: torch.Tensor) -> torch.Tensor:
        return residual_add(h, self.post_norm(y))


class GemmaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, GemmaFFN, GemmaAttention)
        self.embed_tokens.scale = cfg.hidden_size ** 0.5
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.local_rope_theta:   # one lookup per step serves both kinds of layer
            if cfg.rope_depends_on_prompt:
                raise ConfigError("RoPE scaling that depends on the sequence length (dynamic, longrope) "
                                  "on the full-attention layers of a model with local RoPE is not supported")
            local = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.local_rope_theta)
            self.rope.cos = torch.cat((self.rope.cos, local.cos), dim=-1)
            self.rope.sin = torch.cat((self.rope.sin, local.sin), dim=-1)

    def weight_rules(self) -> list[Rule]:
        layer = r"model\.layers\.(\d+)\."
        return [(layer + r"post_attention_layernorm\.weight", r"layers.\1.attn.post_norm.weight", None),
                (layer + r"pre_feedforward_layernorm\.weight", r"layers.\1.ffn.norm.weight", None),
                (layer + r"post_feedforward_layernorm\.weight", r"layers.\1.ffn.post_norm.weight", None),
                *super().weight_rules()]
