"""Which model drafts: parsed from `--speculative`.

    self:K          the target's own first K layers, final norm and (tied) head; weights shared
    self@int4       a copy of the target with every linear layer (head included) in int4
    self@int8       the same in int8
    self:K@int4     the first K layers of that copy
    MODEL[@int4]    another model the loader reads (HF directory, .gguf, 'smollm2'); it must
                    share the target's tokenizer

The quantized copies use the weight-only linears of layers/quant.py (round to nearest; int4 in
groups of 32, int8 per row) and their GEMV kernels, which read 4x (int4) or 2x (int8) fewer
weight bytes than bf16 for the few rows a draft expansion has. Such a copy predicts almost
exactly what the target would, which is what a draft must do: SmolLM2's shipped weights are
Q4_1 in groups of 32 already, so int4 moves its decoder layers by rounding alone. The head is
quantized too (it is a fifth of SmolLM2's weights); the embedding table stays as it is.
"""
from __future__ import annotations

import copy

import torch

from tessera.config import DRAFT_QUANTIZATIONS, ConfigError
from tessera.layers.quant import quantize_model, quantized_linear
from tessera.models.llama import CausalLM

def draft_model(spec: str, target: CausalLM | None, dtype: torch.dtype) -> tuple[CausalLM, range]:
    """(model, layers to run) for a drafter spec (see the module docstring)."""
    name, _, quant = spec.partition("@")
    if quant not in DRAFT_QUANTIZATIONS:
        raise ConfigError(f"unknown draft quantization {quant!r} (int8 and int4 are supported)", "speculative")
    if name == "self" or name.startswith("self:"):
        if target is None:
            raise ConfigError("a self-draft needs the target model", "speculative")
        model = target
    else:
        from tessera.models.loader import load_model
        model, _ = load_model(name, dtype)
        if target is not None and model.config.vocab_size != target.config.vocab_size:
            raise ConfigError(f"the draft's vocabulary ({model.config.vocab_size}) is not the target's "
                              f"({target.config.vocab_size}): a draft must share the tokenizer", "speculative")
    k = len(model.layers)
    if name.startswith("self:"):
        try:
            k = int(name.removeprefix("self:"))
        except ValueError:
            raise ConfigError("self:K needs an integer K", "speculative") from None
        if not 1 <= k <= len(model.layers):
            raise ConfigError(f"self:K needs 1 <= K <= {len(model.layers)}", "speculative")
    if quant:
        model = quantized_copy(model, DRAFT_QUANTIZATIONS[quant], range(k))
    return model, range(k)


def quantized_copy(model: CausalLM, bits: int, layers: range) -> CausalLM:
    """A copy of `model` whose linears in `layers` and head hold `bits`-bit weights (the layers
    a self:K draft never runs are neither copied nor kept)."""
    skipped = [layer for i, layer in enumerate(model.layers) if i not in layers]
    twin = copy.deepcopy(model, memo={id(layer): layer for layer in skipped})   # shared, then dropped
    twin.layers = torch.nn.ModuleList(twin.layers[i] for i in layers)
    quantize_model(twin, bits)
    twin.lm_head = quantized_linear(twin.lm_head, bits)
    return twin
