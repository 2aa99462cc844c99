"""GGUF files (llama.cpp's format): model config from metadata, tensors dequantized to float32
and renamed to Hugging Face names. llama.cpp's converter permutes the rows of q and k into
an interleaved RoPE layout; we undo that so that the same rotate-half RoPE applies."""
from __future__ import annotations

import functools
import pathlib
import re
from typing import Callable, Iterator

import numpy as np
import torch

from tessera.models.gguf_file import GGUFFile, dequantize
from tessera.models.model_config import ModelConfig

_NAMES = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", r"model.layers.\1.self_attn.q_proj.\2"),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", r"model.layers.\1.self_attn.k_proj.\2"),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", r"model.layers.\1.self_attn.v_proj.\2"),
    (r"blk\.(\d+)\.attn_output\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", r"model.layers.\1.mlp.down_proj.weight"),
]


def gguf_config(path: pathlib.Path, file: GGUFFile | None = None) -> ModelConfig:
    file = file or GGUFFile(str(path))
    meta = file.metadata
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only llama)")
    g = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    heads = g("attention.head_count")
    hidden = g("embedding_length")
    names = {t.name for t in file.tensors}
    vocab = g("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        arch="llama", model_type="llama", vocab_size=int(vocab), hidden_size=int(hidden),
        intermediate_size=int(g("feed_forward_length")), num_layers=int(g("block_count")),
        num_heads=int(heads), num_kv_heads=int(g("attention.head_count_kv", heads)),
        head_dim=int(g("rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        max_position_embeddings=int(g("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


def iter_gguf_tensors(path: pathlib.Path) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(HF name, read) per tensor; read() dequantizes it (and undoes llama.cpp's q/k permute)."""
    file = GGUFFile(str(path))
    cfg = gguf_config(path, file)
    for t in file.tensors:
        name = _hf_name(t.name)
        yield name, functools.partial(_read, t, name, cfg)


def _read(t, name: str, cfg: ModelConfig) -> torch.Tensor:
    tensor = torch.from_numpy(np.array(dequantize(t), dtype=np.float32))
    if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
        tensor = _unpermute(tensor, cfg.num_heads)
    elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
        tensor = _unpermute(tensor, cfg.num_kv_heads)
    return tensor


def _hf_name(name: str) -> str:
    for pattern, target in _NAMES:
        m = re.fullmatch(pattern, name)
        if m:
            return m.expand(target)
    raise KeyError(f"unexpected GGUF tensor {name}")


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute: rows (head, pair, half) -> (head, half, pair)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
