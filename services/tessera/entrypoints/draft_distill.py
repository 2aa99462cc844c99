"""`tessera draft distill`: distil a small draft model from a target (spec/distill.py) and write
it as a Hugging Face checkpoint that `--speculative DIR` loads."""
from __future__ import annotations

import argparse
import json

from tessera.config import ConfigError
from tessera.spec.distill import DistillConfig, distill

_D = DistillConfig()


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=_D.target, help="the target: 'smollm2', an HF directory or a .gguf")
    p.add_argument("--out", required=True, help="directory to write (--speculative DIR drafts with it)")
    p.add_argument("--layers", default="0,1,2,3",
                   help="the target's layers the draft starts from, in order (negative: from the end)")
    p.add_argument("--prompts", type=int, default=_D.prompts, help="answers the target generates to learn from")
    p.add_argument("--answer-tokens", type=int, default=_D.answer_tokens, help="longest answer")
    p.add_argument("--train-seconds", type=float, default=_D.train_seconds, help="training time budget")
    p.add_argument("--train-steps", type=int, default=None, help="and at most this many answers trained on")
    p.add_argument("--lr", type=float, default=_D.lr)
    p.add_argument("--top-k", type=int, default=_D.top_k, help="teacher probabilities kept per position")
    p.add_argument("--dtype", default=_D.dtype, choices=("float32", "bfloat16"),
                   help="the target's dtype while it generates and teaches (the draft trains in float32)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=_D.seed)


def main(a: argparse.Namespace) -> int:
    from tessera.models.loader import load_config, resolve_model_path
    num_layers = load_config(resolve_model_path(a.model)).num_layers
    try:
        layers = tuple(int(x) for x in a.layers.split(","))
    except ValueError:
        raise ConfigError(f"--layers must be comma-separated layer numbers, not {a.layers!r}") from None
    if not all(-num_layers <= i < num_layers for i in layers):
        raise ConfigError(f"--layers must be in [-{num_layers}, {num_layers}): the target has {num_layers} layers")
    cfg = DistillConfig(target=a.model, out=a.out, layers=tuple(i % num_layers for i in layers), prompts=a.prompts,
                        answer_tokens=a.answer_tokens, train_seconds=a.train_seconds, train_steps=a.train_steps,
                        lr=a.lr, top_k=a.top_k, dtype=a.dtype, seed=a.seed, threads=a.threads)
    report = distill(cfg)
    print(json.dumps(report, indent=2))
    return 0
