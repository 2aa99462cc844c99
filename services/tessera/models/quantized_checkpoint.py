"""Quantized checkpoints: `tessera quantize` writes one, the loader serves it directly.

A directory holding
    tessera_quantized.json   {"model_config": ..., "bits": [per layer], "group_size": G, "source": ...,
                              "method": "rtn" | "gptq"}
    model.safetensors        dense tensors under our own parameter names, and for every
                             quantized linear NAME.codes (4-bit codes two to a byte, or int8),
                             NAME.scale and NAME.offset (bfloat16)
    tokenizer files          the source's tokenizer (save_pretrained)
Loading (models/loader.py calls `load`) rebuilds each quantized linear from its codes (layers/quant.py) and copies the rest,
so nothing is requantized and no dense copy of a quantized weight ever exists.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

import torch

from tessera.layers.quant import (Int4Linear, Int8Linear, QuantCodes, layer_linears, per_layer_bits, quantize_rtn,
                                  replace_module)
from tessera.models.model_config import ModelConfig

MANIFEST = "tessera_quantized.json"


def is_quantized_checkpoint(path: pathlib.Path) -> bool:
    return (path / MANIFEST).is_file()


def save(net: torch.nn.Module, out: pathlib.Path, bits, group_size: int, source: str,
         codes: dict[str, QuantCodes] | None = None, method: str = "rtn") -> dict:
    """Quantize a loaded (float32) model to per-layer `bits` and write it to `out` (the
    caller adds the tokenizer: entrypoints/quantize.py). codes: precomputed codes by
    "layers.L.NAME" (GPTQ's, pipeline/gptq_pass.py); every other linear is rounded to nearest."""
    from safetensors.torch import save_file
    cfg = net.config
    bits = per_layer_bits(bits, cfg.num_layers)
    tensors: dict[str, torch.Tensor] = {}
    quantized = set()
    for l, (layer, b) in enumerate(zip(net.layers, bits)):
        for name, linear in layer_linears(layer) if b != 16 else []:
            key = f"layers.{l}.{name}"
            q = (codes or {}).get(key) or quantize_rtn(linear.weight, b, group_size)
            tensors[key + ".codes"] = q.codes if b == 8 else _pack_nibbles(q.codes)
            tensors[key + ".scale"], tensors[key + ".offset"] = q.scale, q.offset
            quantized.add(key + ".weight")
    for name, p in net.state_dict().items():
        if name not in quantized and not (cfg.tie_word_embeddings and name == "lm_head.weight"):
            tensors[name] = p.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    manifest = {"model_config": dataclasses.asdict(cfg), "bits": bits, "group_size": group_size, "source": source,
                "method": method}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def manifest_bits(path: pathlib.Path) -> list[int]:
    """The checkpoint's bit-width per layer (16: dense)."""
    return [int(b) for b in json.loads((path / MANIFEST).read_text())["bits"]]


def read_config(path: pathlib.Path) -> ModelConfig:
    raw = json.loads((path / MANIFEST).read_text())["model_config"]
    return ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})


def load(net: torch.nn.Module, path: pathlib.Path) -> None:
    """Fill `net` (built from read_config, possibly pruned) from the checkpoint."""
    from safetensors import safe_open
    manifest = json.loads((path / MANIFEST).read_text())
    group = manifest["group_size"]
    params = dict(net.named_parameters(remove_duplicate=False))
    set_params = set()
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        for l, (layer, b) in enumerate(zip(net.layers, manifest["bits"])):
            for name, linear in layer_linears(layer) if b != 16 else []:
                key = f"layers.{l}.{name}"
                # clone: safetensors' tensors may view the file's memory map, gone after the with
                codes, scale, offset = (f.get_tensor(key + part).clone() for part in (".codes", ".scale", ".offset"))
                q = QuantCodes(codes if b == 8 else _unpack_nibbles(codes), scale, offset,
                               linear.in_features if b == 8 else group)
                replace_module(layer, name, Int8Linear(q, linear.bias) if b == 8 else Int4Linear(q, linear.bias, b))
        params = dict(net.named_parameters(remove_duplicate=False))
        for name, p in params.items():
            if name in keys:
                p.data.copy_(f.get_tensor(name))
                set_params.add(name)
    missing = [n for n in params if n not in set_params and not (n == "lm_head.weight" and net.config.tie_word_embeddings)]
    if missing:
        raise ValueError(f"quantized checkpoint {path} lacks {missing[:8]}")


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
