"""The calibration pass that gives a model's quantized linears GPTQ codes (layers/gptq.py), as
the GPTQ paper runs it: layer by layer over calibration windows (quality.py's first half of
pydoc_data.topics, never a download), each layer's inputs coming from the layers before it
already quantized, so its codes also absorb the error that reaches it.

Within a layer all linears see the dense layer's inputs of one pass (GPTQ's default, not its
"true sequential" variant). `tessera quantize --method gptq` writes the codes to a quantized
checkpoint, which `serve` and the pipeline shards load like any other.
"""
from __future__ import annotations

from typing import Sequence

import torch

from tessera.layers.gptq import gptq
from tessera.layers.quant import QuantCodes, layer_linears, per_layer_bits, quantize_rtn
from tessera.models.driver import run_layers
from tessera.models.llama import CausalLM
from tessera.pipeline import quality


@torch.inference_mode()
def gptq_codes(model: CausalLM, token_windows: list[list[int]], bits: int | Sequence[int],
               group_size: int = 32) -> dict[str, QuantCodes]:
    """{"layers.L.NAME": codes} for every linear of every layer below 16 bits (layer_linears:
    MoE experts are stacked parameters, not linears, and stay dense as with round-to-nearest).
    The model is changed in place: each quantized linear ends up holding its dequantized codes
    (what the later layers' calibration must see). A linear no calibration token reached gets
    round-to-nearest codes."""
    bits = per_layer_bits(bits, len(model.layers))
    runner, batches, xs = None, [], []
    for window in token_windows:
        batch, runner = quality.window_batch(model, window, runner)
        batches.append(batch)
        xs.append(model.embed_tokens(batch.input_ids))

    def layer(l: int) -> list[torch.Tensor]:
        return [run_layers(model, x, batch, runner.kv_caches, range(l, l + 1)) for batch, x in zip(batches, xs)]
    codes: dict[str, QuantCodes] = {}
    for l, b in enumerate(bits):
        if b != 16:
            linears = layer_linears(model.layers[l])
            hessians = {name: torch.zeros(lin.in_features, lin.in_features) for name, lin in linears}
            hooks = [lin.register_forward_pre_hook(_accumulate(hessians[name])) for name, lin in linears]
            try:
                layer(l)
            finally:
                for h in hooks:
                    h.remove()
            for name, lin in linears:
                h = hessians[name]
                q = gptq(lin.weight, h, b, group_size) if h.any() else quantize_rtn(lin.weight, b, group_size)
                codes[f"layers.{l}.{name}"] = q
                lin.weight.copy_(q.dequantize().to(lin.weight.dtype))
        xs = layer(l)
    return codes


def _accumulate(hessian: torch.Tensor):
    """A forward pre-hook adding X^T X of the linear's input rows to `hessian`."""
    def hook(module, args):
        x = args[0].detach().float().reshape(-1, args[0].shape[-1])
        hessian.addmm_(x.T, x)
    return hook
