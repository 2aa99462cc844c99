"""Qwen2-MoE and Qwen3-MoE: the Llama decoder with an MoE FFN half.

Qwen2-MoE adds a shared expert gated by sigmoid(w . x); Qwen3-MoE has none but normalizes q
and k per head (qk_norm). norm_topk_prob comes from the config. Layers listed in
mlp_only_layers (or off the decoder_sparse_step grid) keep a dense SwiGLU FFN.
"""
from __future__ import annotations

from torch import nn

from tessera.models.llama import CausalLM, LlamaFFN, Rule, swiglu_rules
from tessera.models.mixtral import MoEFFN, expert_view
from tessera.models.model_config import ModelConfig


def _make_ffn(cfg: ModelConfig, layer: int) -> nn.Module:
    return MoEFFN(cfg, layer) if cfg.is_moe_layer(layer) else LlamaFFN(cfg, layer)


class QwenMoeForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, _make_ffn)

    def weight_rules(self) -> list[Rule]:
        i = self.config.moe_intermediate_size
        mlp = r"model\.layers\.(\d+)\.mlp\."
        return [
            (mlp + r"gate\.weight", r"layers.\1.ffn.router.gate.weight", None),
            (mlp + r"shared_expert_gate\.weight", r"layers.\1.ffn.shared_gate.weight", None),
            (mlp + r"experts\.(\d+)\.gate_proj\.weight", r"layers.\1.ffn.experts.gate_up",
             expert_view(self, 0, i)),
            (mlp + r"experts\.(\d+)\.up_proj\.weight", r"layers.\1.ffn.experts.gate_up",
             expert_view(self, i, i)),
            (mlp + r"experts\.(\d+)\.down_proj\.weight", r"layers.\1.ffn.experts.down", expert_view(self)),
            *swiglu_rules(mlp + r"shared_expert\.", r"layers.\1.ffn.shared.",
                          self.config.shared_expert_intermediate_size),
            *super().weight_rules(),
        ]
