"""Mixtral: the Llama decoder with a top-k MoE FFN half (softmax router, top-k renormalized).

    out = h + sum_k w_k * expert_{e_k}(rms_norm(h))
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from tessera.layers.moe import Experts, Router
from tessera.layers.norm import RMSNorm
from tessera.layers.mlp import SwiGLU
from tessera.models.llama import CausalLM, FFNInput, Rule
from tessera.models.model_config import ModelConfig


class MoEFFN(nn.Module):
    """The MoE FFN half: norm and router (prepare), routed experts (compute: a node may hold a
    set of them, and returns the sum over the chosen experts it holds), and an optional gated
    shared expert added in finish."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.router = Router(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                             cfg.norm_topk_prob)
        self.experts = Experts(cfg.hidden_size, cfg.moe_intermediate_size, range(cfg.num_experts))
        self.shared = self.shared_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared = SwiGLU(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def prepare(self, h: torch.Tensor) -> FFNInput:
        x = self.norm(h)
        ids, weights = self.router(x)
        return FFNInput(x, ids, weights)

    def compute(self, ffn_in: FFNInput) -> torch.Tensor:
        return self.experts(ffn_in.x, ffn_in.ids, ffn_in.weights)

    def finish(self, h: torch.Tensor, ffn_in: FFNInput, y: torch.Tensor) -> torch.Tensor:
        if self.shared is not None:
            y = y + torch.sigmoid(self.shared_gate(ffn_in.x)) * self.shared(ffn_in.x)
        return h + y

    def shard(self, experts: Sequence[int] | None = None, columns: tuple[int, int] | None = None) -> None:
        """Keep only `experts` (before loading, so that the others are never read, or after);
        `columns` concerns dense FFNs only."""
        if experts is not None:
            self.experts = self.experts.subset(experts)

    def drop_compute(self) -> None:
        """An attention node: the experts live on the expert nodes."""
        self.experts = None

    def drop_ends(self) -> None:
        """An expert node: norm, router and shared expert run on the attention node."""
        self.norm = self.router = self.shared = self.shared_gate = None


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

