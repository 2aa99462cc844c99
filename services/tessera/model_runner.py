"""Owns the model and the KV cache tensors; turns a StepPlan into logits for sampled tokens."""
from __future__ import annotations

import torch

from tessera.batch import build_forward_batch
from tessera.models.driver import forward
from tessera.models.llama import CausalLM
from tessera.models.model_config import ModelConfig
from tessera.scheduler import StepPlan


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int) -> None:
        cfg = model.config
        dtype = model.embed_tokens.weight.dtype
        self.model = model
        self.block_size = block_size
        slots = num_blocks * block_size
        # [kv_heads, slots, head_dim]: a gathered block list is then already [kv_heads, B, L, D]
        self.kv_caches = [
            (torch.zeros(cfg.num_kv_heads, slots, cfg.head_dim, dtype=dtype),
             torch.zeros(cfg.num_kv_heads, slots, cfg.head_dim, dtype=dtype))
            for _ in range(cfg.num_layers)
        ]

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """float32 logits [S, vocab], one row per plan entry with sample=True, in plan order."""
        batch = build_forward_batch(plan, self.block_size)
        hidden = forward(self.model, batch, self.kv_caches)
        return self.model.compute_logits(hidden)
