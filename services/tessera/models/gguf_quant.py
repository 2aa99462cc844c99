"""Serve a GGUF's Q4_0 / Q4_1 linears from their quantized blocks (`--quantization gguf`).

A Q4 block is 32 weights of one row: 4-bit codes q, a float16 scale d (and for Q4_1 an
offset m): w = d*q + m (Q4_0: w = d*(q - 8)). That is layers/quant.py's int4 form with
group 32, so each decoder linear is built from the codes and scales directly, with no dense
copy; fused linears (q|k|v, gate|up) take their rows where the model's weight rules put the
dense rows. Scales are rounded from float16 to bfloat16, the CPU kernel's dtype. Tensors in
other formats (norms, the Q8_0 embedding and tied head) load densely as usual.
"""
from __future__ import annotations

import pathlib

import numpy as np
import torch
from torch import nn

from tessera.layers.quant import Int4Linear, QuantCodes, layer_linears, replace_module
from tessera.models.gguf_file import GGUFFile, GGUFTensor
from tessera.models.gguf_reader import _hf_name, _unpermute, gguf_architecture, gguf_config, is_permuted, rope_heads
from tessera.models.llama import CausalLM, match_rules

Q4_0, Q4_1 = 2, 3
GROUP = 32


def q4_codes(t: GGUFTensor) -> QuantCodes:
    """Codes [N, K] (uint8, 0..15), scales and offsets [N, K/32] of a Q4_0/Q4_1 tensor."""
    n, k = t.shape
    blocks = t.data.reshape(n * k // GROUP, 18 if t.ggml_type == Q4_0 else 20)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(n, k // GROUP)
    head = 2 if t.ggml_type == Q4_0 else 4
    qs = blocks[:, head:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1).reshape(n, k)   # low nibbles first
    m = (-8 * d if t.ggml_type == Q4_0 else
         blocks[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(n, k // GROUP))
    return QuantCodes(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m), GROUP)


def load_gguf_quantized(model: CausalLM, path: pathlib.Path) -> int:
    """Fill the decoder linears whose every source tensor is Q4_0/Q4_1 from their blocks and
    swap in Int4Linear; return how many linears were built so. The caller then loads the other
    tensors densely (load_weights skips the swapped linears' weights: they are no longer params)."""
    file = GGUFFile(str(path))
    cfg, arch = gguf_config(path, file), gguf_architecture(file)
    targets = {f"layers.{l}.{name}.weight": linear for l, layer in enumerate(model.layers)
               for name, linear in layer_linears(layer)}
    rows = {name: torch.arange(lin.out_features) for name, lin in targets.items()}
    parts: dict[str, list[tuple[torch.Tensor, GGUFTensor]]] = {}
    for t in file.tensors:
        found = match_rules(rows, _hf_name(t.name, arch), model.weight_rules()) if t.name.startswith("blk.") else None
        if found is not None:
            parts.setdefault(found[0], []).append((found[1], t))
    built = 0
    for name, linear in targets.items():
        pieces = parts.get(name, [])
        covered = sum(len(idx) for idx, _ in pieces)
        if covered != linear.out_features or any(t.ggml_type not in (Q4_0, Q4_1) for _, t in pieces):
            continue
        codes = _assemble(linear, pieces, cfg, arch)
        replace_module(model, name.removesuffix(".weight"), Int4Linear.from_codes(codes, linear.bias))
        built += 1
    return built


def _assemble(linear: nn.Linear, pieces, cfg, arch: str) -> QuantCodes:
    n, k = linear.out_features, linear.in_features
    codes = torch.empty(n, k, dtype=torch.uint8)
    scale, offset = torch.empty(n, k // GROUP), torch.empty(n, k // GROUP)
    for idx, t in pieces:
        q = q4_codes(t)
        # llama.cpp permutes the rows of q and k for some architectures (gguf_reader undoes it densely)
        heads = rope_heads(_hf_name(t.name, arch), cfg) if is_permuted(arch) else None
        c, s, o = (q.codes, q.scale, q.offset) if heads is None else (
            _unpermute(q.codes, heads), _unpermute(q.scale, heads), _unpermute(q.offset, heads))
        codes[idx], scale[idx], offset[idx] = c, s, o
    return QuantCodes(codes, scale, offset, GROUP)

