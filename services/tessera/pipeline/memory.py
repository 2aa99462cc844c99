"""A stage's memory: the bytes of the weights it holds (as loaded: quantized layers count their
codes and scales) and of its KV cache (its layers only), checked against --memory-gib before
the cache is allocated (docs/design/pipeline.md#invariants: memory per device within its budget)."""
from __future__ import annotations

import torch
from torch import nn

from tessera.config import CacheConfig, ConfigError
from tessera.model_runner import kv_bytes_per_block
from tessera.models.model_config import ModelConfig

GIB = 2 ** 30


class MemoryBudgetExceeded(ConfigError):
    """A stage's weights and KV cache do not fit its memory budget."""


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every tensor the model holds (a tied weight once)."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.numel() * t.element_size())
    return sum(seen.values())


def kv_bytes(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, layers: range) -> int:
    return kv_bytes_per_block(cfg, block_size, dtype) // cfg.num_layers * len(layers) * num_blocks


def num_kv_blocks(cache: CacheConfig, cfg: ModelConfig, dtype: torch.dtype) -> int:
    """The Engine's rule (engine.py), so that every stage of a pipeline sizes the same block
    count from the same flags: kv_cache_gib is the whole model's KV, spread over the stages."""
    return cache.num_blocks or max(1, int(cache.kv_cache_gib * GIB // kv_bytes_per_block(cfg, cache.block_size, dtype)))


def check_budget(stage: int, weights: int, kv: int, memory_gib: float | None) -> None:
    """Raise MemoryBudgetExceeded (with the numbers) when weights + kv exceed memory_gib."""
    if memory_gib is None or weights + kv <= memory_gib * GIB:
        return
    raise MemoryBudgetExceeded(
        f"stage {stage} needs {(weights + kv) / GIB:.3f} GiB ({weights / GIB:.3f} GiB of weights + "
        f"{kv / GIB:.3f} GiB of KV cache), more than its --memory-gib {memory_gib:g}; give it fewer layers, "
        "fewer bits or fewer KV blocks (--num-kv-blocks / --kv-cache-gib)")
