"""The one layer driver: every way of running a model composes the same per-layer pieces.

    h      = x + layer.attn(x)             attention half, KV written to the paged cache
    ffn_in = layer.ffn.prepare(h)          norm (and router)
    y      = layer.ffn.compute(ffn_in)     here, or on expert nodes
    x      = layer.ffn.finish(h, ffn_in, y)

`layer_steps` runs a contiguous range of layers and pauses at every FFN compute, handing the
caller (layer, ffn_in) and taking y back, so the caller decides where the compute happens:
`run_layers` computes it in this process (the monolithic engine, a pipeline shard: hidden
states in, hidden states out); disagg/attention_runner.py sends it to expert nodes and
interleaves micro-batches between the pauses. Tree verification passes explicit positions
(RoPE only: KV slots stay those of the ForwardBatch) and per-chunk attention masks.
"""
from __future__ import annotations

from typing import Generator, Sequence

import torch

from tessera.batch import ForwardBatch
from tessera.layers.residual import residual_add
from tessera.models.llama import CausalLM, FFNInput

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]   # kv_caches[l]: layer l's (k, v)
LayerSteps = Generator[tuple[int, FFNInput], torch.Tensor, torch.Tensor]


def layer_steps(model: CausalLM, x: torch.Tensor, batch: ForwardBatch, kv_caches: KVCaches,
                layers: range, positions: torch.Tensor | None = None,
                masks: Sequence[torch.Tensor | None] | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> LayerSteps:
    """Run `layers` on hidden states x [T, H]: yields (layer, ffn_in) at each FFN, expects that
    FFN's compute output to be sent back, and returns the hidden states after the last layer.
    positions default to batch.positions (RoPE scaling that depends on the prompt's length
    takes it from batch.prompt_lens); masks: see layers/attention.paged_attention; rope: the
    positions' (cos, sin) when the caller has them already (step_graph.py)."""
    if rope is None:
        rope = model.rope(batch.positions if positions is None else positions, x.dtype, batch.prompt_lens)
    for l in layers:
        layer = model.layers[l]
        h = residual_add(x, layer.attn(x, batch, kv_caches[l], rope, masks))
        ffn_in = layer.ffn.prepare(h)
        y = yield l, ffn_in
        x = layer.ffn.finish(h, ffn_in, y)
    return x


def run_layers(model: CausalLM, x: torch.Tensor, batch: ForwardBatch, kv_caches: KVCaches,
               layers: range | None = None, positions: torch.Tensor | None = None,
               masks: Sequence[torch.Tensor | None] | None = None,
               rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Layers `layers` (default: all) with every FFN computed in this process."""
    steps = layer_steps(model, x, batch, kv_caches, range(len(model.layers)) if layers is None else layers,
                        positions, masks, rope)
    y = None
    while True:
        try:
            l, ffn_in = steps.send(y)
        except StopIteration as done:
            return done.value
        y = model.layers[l].ffn.compute(ffn_in)


def final_hidden(model: CausalLM, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """The final norm of the tokens whose logits are sampled (batch.logits_idx)."""
    return model.norm(x[batch.logits_idx])


def forward(model: CausalLM, batch: ForwardBatch, kv_caches: KVCaches, positions: torch.Tensor | None = None,
            masks: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
    """The whole model in this process: final hidden states of the batch.logits_idx tokens."""
    x = run_layers(model, model.embed_tokens(batch.input_ids), batch, kv_caches, None, positions, masks)
    return final_hidden(model, x, batch)
