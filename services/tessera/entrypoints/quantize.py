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
    p.add_argument("--method", choices=("rtn", "gptq"), default="rtn",
                   help="rtn: round to nearest; gptq: codes fitted to calibration text (GPTQ)")
    p.add_argument("--calibration-windows", type=int, default=16,
                   help="gptq: windows of 256 tokens of the calibration text (pydoc_data.topics, first half)")
    p.add_argument("--eval-windows", type=int, default=0,
                   help="then print the checkpoint's held-out perplexity over this many 256-token windows")
    p.add_argument("--out", required=True, help="directory to write (tessera serve --model DIR serves it)")


def main(a: argparse.Namespace) -> int:
    model, group_size, out = a.model, a.group_size, a.out
    bits = parse_quantization(a.bits, load_config(resolve_model_path(model)).num_layers)
    if not isinstance(bits, list):
        raise ConfigError("--bits must be int8, int4, int3 or a plan file with 'bits'")
    if a.calibration_windows < 1 or a.eval_windows < 0:
        raise ConfigError("--calibration-windows must be >= 1 and --eval-windows >= 0")
    net, _ = load_model(model, torch.float32)
    tokenizer = load_tokenizer(model)
    codes = None
    if a.method == "gptq":
        from tessera.pipeline import quality
        from tessera.pipeline.gptq_pass import gptq_codes
        codes = gptq_codes(net, quality.windows(tokenizer, "calibration", a.calibration_windows, 256), bits, group_size)
    manifest = quantized_checkpoint.save(net, pathlib.Path(out), bits, group_size, model, codes, a.method)
    tokenizer.save_pretrained(out)
    print(f"wrote {out}: {a.method}, bits per layer {manifest['bits']}, group size {group_size}")
    if a.eval_windows:
        from tessera.pipeline import quality
        served, _ = load_model(out, torch.bfloat16)
        ppl = quality.perplexity(served, quality.windows(tokenizer, "heldout", a.eval_windows, 256))
        print(f"held-out perplexity ({a.eval_windows} x 256 tokens, bfloat16): {ppl:.3f}")
    return 0
