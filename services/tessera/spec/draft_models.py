"""Which model drafts: parsed from `--speculative`.

    self:K          the target's own first K layers, final norm and (tied) head; weights shared
    self@int8       a copy of the target with every linear layer (head included) in int8
    self:K@int8     the first K layers of that copy
    MODEL[@int8]    another model the loader reads (HF directory, .gguf, 'smollm2'); it must
                    share the target's tokenizer

int8 is torch's dynamic quantization (per-channel int8 weights, activations quantized per
call, fbgemm kernels): on this CPU a batch-4 matmul with SmolLM2's head takes ~1 ms instead
of ~18 ms in float32, and the copy predicts almost exactly what the target would, which is
what a draft must do. (The LLM-PQ issue brings weight-only int8/int4 linears of our own.)
"""
from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from tessera.config import ConfigError
from tessera.models.llama import CausalLM


def draft_model(spec: str, target: CausalLM | None, dtype: torch.dtype) -> tuple[CausalLM, range]:
    """(model, layers to run) for a drafter spec (see the module docstring)."""
    name, _, quant = spec.partition("@")
    if quant not in ("", "int8"):
        raise ConfigError(f"unknown draft quantization {quant!r} (int8 is supported)", "speculative")
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
    if quant == "int8":
        model = int8_copy(model)
    return model, range(k)


def int8_copy(model: CausalLM) -> CausalLM:
    """A float32 copy of `model` whose nn.Linear layers (head included) run in int8."""
    if model.embed_tokens.weight.dtype != torch.float32:
        model = copy.deepcopy(model).float()
    else:
        model = copy.deepcopy(model)
    with warnings.catch_warnings():           # torch.ao's eager API is deprecated, still supported
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(
            model, {nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig}, inplace=True)
