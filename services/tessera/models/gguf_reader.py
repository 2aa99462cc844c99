"""GGUF files (llama.cpp's format): model config from metadata (gguf_metadata), tensors
dequantized to float32 and renamed to Hugging Face names. llama.cpp's converter changes some
tensors on the way in; we undo each change so that the model files see HF's weights:
  - llama and granite: rows of q and k permuted into an interleaved RoPE layout (the other
    architectures run rotate-half RoPE in llama.cpp too and are stored unpermuted);
  - Gemma 2 and 3: every norm weight stored as 1 + w (llama.cpp's norm multiplies by w);
  - Phi-3: gate and up fused into ffn_up, q, k and v into attn_qkv (as in HF's checkpoint)."""
from __future__ import annotations

import functools
import pathlib
import re
from typing import Callable, Iterator

import numpy as np
import torch

from tessera.config import ConfigError
from tessera.models.gguf_file import GGUFFile, dequantize, open_gguf
from tessera.models.gguf_metadata import hf_config
from tessera.models.model_config import ModelConfig

_LAYER = r"blk\.(\d+)\."
_NAMES = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (_LAYER + r"attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (_LAYER + r"attn_q\.(weight|bias)", r"model.layers.\1.self_attn.q_proj.\2"),
    (_LAYER + r"attn_k\.(weight|bias)", r"model.layers.\1.self_attn.k_proj.\2"),
    (_LAYER + r"attn_v\.(weight|bias)", r"model.layers.\1.self_attn.v_proj.\2"),
    (_LAYER + r"attn_qkv\.(weight|bias)", r"model.layers.\1.self_attn.qkv_proj.\2"),
    (_LAYER + r"attn_output\.(weight|bias)", r"model.layers.\1.self_attn.o_proj.\2"),
    (_LAYER + r"attn_q_norm\.weight", r"model.layers.\1.self_attn.q_norm.weight"),
    (_LAYER + r"attn_k_norm\.weight", r"model.layers.\1.self_attn.k_norm.weight"),
    (_LAYER + r"post_attention_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (_LAYER + r"post_ffw_norm\.weight", r"model.layers.\1.post_feedforward_layernorm.weight"),
    (_LAYER + r"ffn_gate\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (_LAYER + r"ffn_down\.weight", r"model.layers.\1.mlp.down_proj.weight"),
]
# names whose HF counterpart depends on the architecture
_FFN_NORM = dict.fromkeys(("gemma2", "gemma3"), "pre_feedforward_layernorm")   # else post_attention_layernorm
_FFN_UP = {"phi3": "gate_up_proj"}                              # else up_proj
_PERMUTED = ("llama", "granite")       # q and k rows interleaved by the converter
_NORM_PLUS_ONE = ("gemma2", "gemma3")  # norms stored as 1 + w
# read into the config: Llama 3 rope scaling, Phi-3's LongRoPE factors
_SKIPPED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def gguf_config(path: pathlib.Path, file: GGUFFile | None = None) -> ModelConfig:
    file = file or open_gguf(path)
    return ModelConfig.from_hf(hf_config(file.metadata, {t.name: t for t in file.tensors}))


def gguf_architecture(file: GGUFFile) -> str:
    return file.metadata.get("general.architecture", "")


def iter_gguf_tensors(path: pathlib.Path) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(HF name, read) per tensor; read() dequantizes it and undoes the converter's changes."""
    file = open_gguf(path)
    cfg, arch = gguf_config(path, file), gguf_architecture(file)
    for t in file.tensors:
        if t.name in _SKIPPED:
            continue
        name = _hf_name(t.name, arch)
        yield name, functools.partial(_read, t, name, cfg, arch)


def _read(t, name: str, cfg: ModelConfig, arch: str) -> torch.Tensor:
    tensor = torch.from_numpy(np.array(dequantize(t), dtype=np.float32))
    if arch in _PERMUTED:
        heads = rope_heads(name, cfg)
        if heads is not None:
            tensor = _unpermute(tensor, heads)
    if arch in _NORM_PLUS_ONE and name.endswith("norm.weight"):
        tensor = tensor - 1.0
    return tensor


def rope_heads(hf_name: str, cfg: ModelConfig) -> int | None:
    """How many heads a permuted q or k tensor holds (None: not one of them)."""
    if re.search(r"q_proj\.(weight|bias)$", hf_name):
        return cfg.num_heads
    if re.search(r"k_proj\.(weight|bias)$", hf_name):
        return cfg.num_kv_heads
    return None


def is_permuted(arch: str) -> bool:
    return arch in _PERMUTED


def _hf_name(name: str, arch: str = "llama") -> str:
    m = re.fullmatch(_LAYER + r"(ffn_norm|ffn_up)\.weight", name)
    if m:
        hf = (_FFN_NORM.get(arch, "post_attention_layernorm") if m[2] == "ffn_norm"
              else "mlp." + _FFN_UP.get(arch, "up_proj"))
        return f"model.layers.{m[1]}.{hf}.weight"
    for pattern, target in _NAMES:
        m = re.fullmatch(pattern, name)
        if m:
            return m.expand(target)
    raise ConfigError(f"unexpected GGUF tensor {name} (a variant of the architecture that Tessera does not implement)")


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute: rows (head, pair, half) -> (head, half, pair)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
