"""`tessera quantize`: load a model, quantize it per layer, write a quantized checkpoint
(models/quantized_checkpoint.py) with the model's tokenizer beside it."""
from __future__ import annotations

import argparse
import pathlib

import torch

from tessera.config import ConfigError
from tessera.layers.quant import parse_quantization
from tessera.models import quantized_checkpoint
from tessera.models.loader import load_config, load_model, resolve_model_path
from tessera.tokenizer import load_tokenizer


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default="smollm2", help="'smollm2', an HF directory or a .gguf file")
    p.add_argument("--bits", default="int4", help="int8, int4, int3, or a plan JSON with per-layer 'bits'")
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--out", required=True, help="directory to write (tessera serve --model DIR serves it)")


def main(a: argparse.Namespace) -> int:
    model, group_size, out = a.model, a.group_size, a.out
    bits = parse_quantization(a.bits, load_config(resolve_model_path(model)).num_layers)
    if not isinstance(bits, list):
        raise ConfigError("--bits must be int8, int4, int3 or a plan file with 'bits'")
    net, _ = load_model(model, torch.float32)
    manifest = quantized_checkpoint.save(net, pathlib.Path(out), bits, group_size, model)
    load_tokenizer(model).save_pretrained(out)
    print(f"wrote {out}: bits per layer {manifest['bits']}, group size {group_size}")
    return 0
