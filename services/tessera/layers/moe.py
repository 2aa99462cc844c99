"""Mixture of experts: a router picks top-k experts per token; experts are SwiGLU MLPs.

Router and experts are separate modules because an attention node runs the router and sends
each token to the expert nodes that own its experts (MegaScale-Infer); in one process they
are simply called one after the other: y = sum_k w_k * expert_{e_k}(x).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (expert ids [T, k] int64, weights [T, k] in x's dtype)."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype)


class Experts(nn.Module):
    """Experts `ids` of a layer (all of them, or an expert node's share, in any order), stacked
    in that order: gate_up [E, 2I, H], down [E, H, I]."""

    def __init__(self, hidden: int, intermediate: int, ids, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.ids = tuple(int(i) for i in ids)
        self.local = {expert: i for i, expert in enumerate(self.ids)}
        E = len(self.ids)
        self.gate_up = nn.Parameter(torch.empty(E, 2 * intermediate, hidden, device=device), requires_grad=False)
        self.down = nn.Parameter(torch.empty(E, hidden, intermediate, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sum of w * expert(x) over each token's chosen experts that this module holds."""
        out = torch.zeros_like(x)
        for expert in torch.unique(ids).tolist():
            e = self.local.get(expert)
            if e is None:
                continue
            token, slot = torch.where(ids == expert)
            gate, up = F.linear(x[token], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[e])
            out.index_add_(0, token, y * weights[token, slot, None])
        return out

    def subset(self, ids) -> "Experts":
        """These experts narrowed to `ids` (held here, in any order), rows copied; self when
        nothing changes."""
        ids = tuple(int(i) for i in ids)
        if ids == self.ids:
            return self
        missing = [e for e in ids if e not in self.local]
        if missing:
            raise ValueError(f"experts {missing} are not held here (held: {list(self.ids)})")
        rows = [self.local[e] for e in ids]
        part = Experts(self.gate_up.shape[2], self.down.shape[2], ids, device="meta")
        part.gate_up = nn.Parameter(self.gate_up.data[rows], requires_grad=False)
        part.down = nn.Parameter(self.down.data[rows], requires_grad=False)
        return part
