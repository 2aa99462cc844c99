"""`tessera quantize`: load a model, quantize it per layer, write a quantized checkpoint
(models/quantized_checkpoint.py) with the model's tokenizer beside it."""
from __future__ import annotations

import argparse
import pathlib

import torch

from tessera.config import ConfigError
from tessera.layers.quant import layer_linears, parse_quantization
from tessera.models import quantized_checkpoint
from tessera.models.loader import load_config, load_model, resolve_model_path
from tessera.pipeline import quality
from tessera.pipeline.gptq_pass import gptq_codes
from tessera.tokenizer import load_tokenizer

WINDOW = 256    # tokens per calibration and evaluation window


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default="smollm2", help="'smollm2', an HF directory or a .gguf file")
    p.add_argument("--bits", default="int4", help="int8, int4, int3, or a plan JSON with per-layer 'bits'")
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--method", choices=("rtn", "gptq"), default="rtn",
                   help="rtn: round to nearest; gptq: codes fitted to calibration text (GPTQ)")
    p.add_argument("--calibration-windows", type=int, default=16,
                   help=f"gptq: windows of {WINDOW} tokens of the calibration text (pydoc_data.topics, first half)")
    p.add_argument("--eval-windows", type=int, default=0,
                   help=f"then print the checkpoint's held-out perplexity over this many {WINDOW}-token windows")
    p.add_argument("--out", required=True, help="directory to write (tessera serve --model DIR serves it)")


def main(a: argparse.Namespace) -> int:
    model, group_size, out = a.model, a.group_size, a.out
    bits = parse_quantization(a.bits, load_config(resolve_model_path(model)).num_layers)
    if not isinstance(bits, list):
        raise ConfigError("--bits must be int8, int4, int3 or a plan file with 'bits'")
    if a.method == "gptq" and a.calibration_windows < 1:
        raise ConfigError("--calibration-windows must be >= 1")
    if a.eval_windows < 0:
        raise ConfigError("--eval-windows must be >= 0")
    net, _ = load_model(model, torch.float32)
    _check_group_size(net, bits, group_size)
    tokenizer = load_tokenizer(model)
    calibration = _windows(tokenizer, "calibration", a.calibration_windows if a.method == "gptq" else 0)
    heldout = _windows(tokenizer, "heldout", a.eval_windows)
    codes = gptq_codes(net, calibration, bits, group_size) if a.method == "gptq" else None
    manifest = quantized_checkpoint.save(net, pathlib.Path(out), bits, group_size, model, codes, a.method)
    tokenizer.save_pretrained(out)
    print(f"wrote {out}: {a.method}, bits per layer {manifest['bits']}, group size {group_size}")
    if heldout:
        served, _ = load_model(out, torch.bfloat16)
        print(f"held-out perplexity ({len(heldout)} x {WINDOW} tokens, bfloat16): {quality.perplexity(served, heldout):.3f}")
    return 0


def _check_group_size(net, bits: list[int], group_size: int) -> None:
    """int4/int3 groups: a positive multiple of the kernels' run that divides every input size."""
    from tessera_kernels.gemv_quant_cpu import RUN
    if not any(b in (3, 4) for b in bits):
        return
    sizes = sorted({lin.in_features for layer in net.layers for _, lin in layer_linears(layer)})
    if group_size <= 0 or group_size % RUN or any(k % group_size for k in sizes):
        raise ConfigError(f"--group-size {group_size}: int4/int3 groups must be a multiple of {RUN} that "
                          f"divides every linear's input size {sizes}")


def _windows(tokenizer, split: str, num: int) -> list[list[int]]:
    try:
        return quality.windows(tokenizer, split, num, WINDOW) if num else []
    except ValueError as e:
        raise ConfigError(f"{e}: ask for fewer windows") from None
