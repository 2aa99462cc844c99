"""OLMo 2: the Llama decoder with its norms after the sublayers instead of before them, and
q/k normalized over the whole projection (all heads at once) rather than per head:
    h   = x + rms_norm(attention(x))        q = rms_norm(W_q x), k = rms_norm(W_k x)
    out = h + rms_norm(mlp(h))
"""
from __future__ import annotations

import torch

from tessera.layers.norm import RMSNorm
from tessera.layers.residual import residual_add
from tessera.models.llama import CausalLM, FFNInput, LlamaAttention, LlamaFFN, Rule
from tessera.models.model_config import ModelConfig


class Olmo2Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__(cfg, layer)
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.norm = None    # no pre-norm
        self.q_norm, self.k_norm = RMSNorm(q, cfg.rms_norm_eps), RMSNorm(kv, cfg.rms_norm_eps)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, batch, kv, rope, masks=None) -> torch.Tensor:
        return self.post_norm(self.attend(*self.project(x), batch, kv, rope, masks))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T, H, KV, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        q, k = self.q_norm(qkv[:, :H * D]), self.k_norm(qkv[:, H * D:(H + KV) * D])
        return torch.cat((q, k), dim=1).view(T, H + KV, D), qkv[:, (H + KV) * D:].view(T, KV, D)


class Olmo2FFN(LlamaFFN):
    """norm is the post-FFN norm: prepare passes h through, finish normalizes the MLP's output
    (after the expert nodes' partial outputs are summed, on an AFD path)."""

    def prepare(self, h: torch.Tensor) -> FFNInput:
        return FFNInput(h)

    def finish(self, h: torch.Tensor, ffn_in: FFNInput, y: torch.Tensor) -> torch.Tensor:
        return residual_add(h, self.norm(y))


class Olmo2ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, Olmo2FFN, Olmo2Attention)

    def weight_rules(self) -> list[Rule]:
        layer = r"model\.layers\.(\d+)\."
        return [(layer + r"post_attention_layernorm\.weight", r"layers.\1.attn.post_norm.weight", None),
                (layer + r"post_feedforward_layernorm\.weight", r"layers.\1.ffn.norm.weight", None),
                *super().weight_rules()]
