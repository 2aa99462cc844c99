"""Owns the model and the KV cache tensors; turns a StepPlan into logits for sampled tokens."""
from __future__ import annotations

import torch

from tessera import huge_pages
from tessera.batch import build_forward_batch
from tessera.step_graph import StepGraphs
from tessera.models.driver import forward
from tessera.models.llama import CausalLM
from tessera.models.model_config import ModelConfig
from tessera.scheduler import StepPlan
from tessera_kernels import kv_int8


def kv_row_shape(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """The last dimension of a KV cache of this dtype: the head size, or an int8 row's bytes
    (values and their scale, tessera_kernels.kv_int8)."""
    return kv_int8.row_bytes(cfg.head_dim) if dtype == torch.int8 else cfg.head_dim


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one block, in a cache of this dtype (int8: scales included)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * kv_row_shape(cfg, dtype) * elem


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """CacheConfig.kv_cache_dtype as a torch dtype: 'auto' is the model's."""
    return {"auto": model_dtype, "int8": torch.int8}[name]


def allocate_kv(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                layers: range | None = None) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """K and V of every layer in `layers` (default: all); None for a layer this process does not
    hold (a pipeline stage). [kv_heads, slots, head_dim]: a gathered block list is then already
    [kv_heads, B, L, D]; int8: [kv_heads, slots, head_dim + 4] (kv_row_shape). On 2 MiB pages
    (huge_pages.py)."""
    slots = num_blocks * block_size
    held = range(cfg.num_layers) if layers is None else layers
    shape = (cfg.num_kv_heads, slots, kv_row_shape(cfg, dtype))
    return [(huge_pages.zeros(shape, dtype), huge_pages.zeros(shape, dtype)) if l in held else None
            for l in range(cfg.num_layers)]


class ModelRunner:
    compute_s = 0.0   # a pipeline's first stage (PipelineRunner) counts the seconds in its layers here
    graphs: StepGraphs | None = None
    # Whether decode graphs may stand in for driver.forward in execute: no in a subclass with
    # an execute of its own (AFD, pipeline stages).
    step_graphs_apply = True

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, layers: range | None = None,
                 kv_dtype: torch.dtype | None = None) -> None:
        """layers: the decoder layers this process holds KV for (default: all); kv_dtype: the
        cache's (default: the model's; torch.int8: an int8 cache, tessera_kernels.kv_int8)."""
        self.model = model
        self.block_size = block_size
        self.kv_caches = allocate_kv(model.config, num_blocks, block_size, kv_dtype or model.embed_tokens.weight.dtype,
                                     layers)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """float32 logits [S, vocab], one row per plan entry with sample=True, in plan order."""
        batch = build_forward_batch(plan, self.block_size)
        if self.graphs is not None:
            hidden = self.graphs.forward(batch)
        else:
            hidden = forward(self.model, batch, self.kv_caches)
        return self.model.compute_logits(hidden)

    def replay_steps(self, max_blocks: int, max_step_tokens: int, check_every: int = 0) -> None:
        """Replay the kernel calls of steps of up to max_step_tokens tokens, of requests of at
        most max_blocks KV blocks each, every check_every-th checked against the eager step
        too (0: only each graph's first; step_graph.py)."""
        self.graphs = StepGraphs(self.model, self.kv_caches, max_blocks, max_step_tokens, check_every)

    @torch.inference_mode()
    def keep_path(self, block_table: tuple[int, ...], start_pos: int, nodes: list[int]) -> None:
        """After a tree verification: the KV of accepted tree nodes (offsets after the root at
        start_pos) moves to the positions start_pos + 1, + 2, ... where a plain decode would
        have written it; the rejected nodes' KV is left to be overwritten."""
        if nodes == list(range(1, len(nodes) + 1)):
            return
        bs = self.block_size

        def slot(pos: int) -> int:
            return block_table[pos // bs] * bs + pos % bs
        src = torch.tensor([slot(start_pos + n) for n in nodes])
        dst = torch.tensor([slot(start_pos + 1 + i) for i in range(len(nodes))])
        for k, v in self.kv_caches:
            k[:, dst] = k[:, src]
            v[:, dst] = v[:, src]
