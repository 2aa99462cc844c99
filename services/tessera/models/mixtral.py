"""Mixtral: the Llama decoder with a top-k MoE FFN half (softmax router, top-k renormalized).

    out = h + sum_k w_k * expert_{e_k}(rms_norm(h))
"""
from __future__ import annotations

import torch
from torch import nn

from tessera.layers.moe import Experts, Router
from tessera.layers.norm import RMSNorm
from tessera.layers.mlp import SwiGLU
from tessera.models.llama import CausalLM, Rule
from tessera.models.model_config import ModelConfig


class MoEFFN(nn.Module):
    """The MoE FFN half: norm, router, routed experts, and an optional gated shared expert."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.router = Router(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                             cfg.norm_topk_prob)
        self.experts = Experts(cfg.hidden_size, cfg.moe_intermediate_size, range(cfg.num_experts))
        self.shared = None
        if cfg.shared_expert_intermediate_size:
            self.shared = SwiGLU(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        ids, weights = self.router(x)
        out = self.experts(x, ids, weights)
        if self.shared is not None:
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        return out


def expert_view(model: CausalLM, first_row: int = 0, size: int | None = None):
    """A view into expert e's part of layer l's stacked [E, rows, cols] parameter (groups 1, 2 =
    l, e); None when this model does not hold expert e (an expert node holds a share)."""
    def view(p: torch.Tensor, m) -> torch.Tensor | None:
        e = model.layers[int(m.group(1))].ffn.experts.local.get(int(m.group(2)))
        if e is None:
            return None
        return p[e] if size is None else p[e].narrow(0, first_row, size)
    return view


class MixtralForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, MoEFFN)

    def weight_rules(self) -> list[Rule]:
        i = self.config.moe_intermediate_size
        moe = r"model\.layers\.(\d+)\.block_sparse_moe\."
        return super().weight_rules() + [
            (moe + r"gate\.weight", r"layers.\1.ffn.router.gate.weight", None),
            (moe + r"experts\.(\d+)\.w1\.weight", r"layers.\1.ffn.experts.gate_up", expert_view(self, 0, i)),
            (moe + r"experts\.(\d+)\.w3\.weight", r"layers.\1.ffn.experts.gate_up", expert_view(self, i, i)),
            (moe + r"experts\.(\d+)\.w2\.weight", r"layers.\1.ffn.experts.down", expert_view(self)),
        ]

