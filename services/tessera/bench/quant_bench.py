"""`tessera bench quant`: decode speed and held-out perplexity of the model at 16/8/4(/3) bits.

Rows {"bits", "source", "dtype", "batch", "output_tok_s", "tpot_ms", "perplexity"}: the engine
(no HTTP) generating --output-len greedy tokens per request at each batch, and perplexity on
the held-out half of pydoc_data.topics (pipeline/quality.py). 16-bit rows run each dense dtype
(float32, bfloat16), so the quantized rows can be held against the fastest of them; `gguf`
rows serve the checkpoint's own Q4 blocks. With --kernels, rows {"kind": "linear", "bits",
"batch", "us"}: one linear of each of the model's shapes at each bit-width and row count.
Everything here is measured on this machine, in one run.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from tessera.bench.results import add_out_arg

DEFAULT_KINDS = "16:float32,16:bfloat16,8,4,gguf"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2")
    p.add_argument("--kinds", default=DEFAULT_KINDS,
                   help="comma list: 16:DTYPE (dense), 8, 4, 3 (bfloat16 activations), gguf (the file's Q4 blocks)")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--ppl-windows", type=int, default=8, help="held-out windows of --ppl-len tokens")
    p.add_argument("--ppl-len", type=int, default=256)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--kernels", action="store_true", help="also time single linears per (bits, batch)")
    p.add_argument("--json", action="store_true")
    add_out_arg(p)


def _engine(model: str, kind: str):
    from tessera.config import EngineConfig
    from tessera.engine import Engine
    bits, _, dtype = kind.partition(":")
    quant = {"16": None, "gguf": "gguf"}.get(bits, f"int{bits}")
    return Engine(EngineConfig(model=model, dtype=dtype or "bfloat16", quantization=quant)), bits, dtype or "bfloat16"


def model_rows(a: argparse.Namespace) -> list[dict]:
    from tessera.bench.engine_bench import run_engine
    from tessera.pipeline import quality
    rows = []
    windows = None
    for kind in (k for k in a.kinds.split(",") if k):
        engine, bits, dtype = _engine(a.model, kind)
        windows = windows or quality.windows(engine.tokenizer, "heldout", a.ppl_windows, a.ppl_len)
        ppl = quality.perplexity(engine.runner.model, windows)
        for b in (int(x) for x in a.batch_sizes.split(",") if x):
            r = run_engine(engine, b, a.input_len, a.output_len)
            rows.append({"bits": 4 if bits == "gguf" else int(bits), "source": "gguf-q4" if bits == "gguf" else "rtn",
                         "dtype": dtype, "batch": b, "output_tok_s": r["output_tok_s"], "tpot_ms": r["tpot_ms"],
                         "perplexity": round(ppl, 3)})
        del engine
    return rows


def kernel_rows(model: str, batches=(1, 4, 16, 32, 64)) -> list[dict]:
    """One linear per distinct (out, in) shape of the model's first layer, timed per bits and rows."""
    from tessera.layers.quant import layer_linears, quantized_linear
    from tessera.models.loader import load_model
    net, _ = load_model(model, torch.bfloat16)
    rows = []
    for name, lin in layer_linears(net.layers[0]):
        for bits in (16, 8, 4):
            q = quantized_linear(lin, bits)
            for m in batches:
                x = torch.randn(m, lin.in_features, dtype=torch.bfloat16)
                rows.append({"kind": "linear", "name": name, "shape": [lin.out_features, lin.in_features],
                             "bits": bits, "batch": m, "us": round(_time(lambda: q(x)) * 1e6, 1)})
    return rows


@torch.inference_mode()
def _time(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def main(a: argparse.Namespace) -> int:
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = model_rows(a)
    if a.kernels:
        rows += kernel_rows(a.model)
    if a.out:
        from tessera.bench import results, rows as schema
        results.write(a.out, schema.quant(a, rows))
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            print("  ".join(f"{k}={v}" for k, v in r.items()))
    return 0
