"""GGUF files of each family, written the way llama.cpp's convert_hf_to_gguf.py writes them
(the gguf package's GGUFWriter and tensor name map; q/k permuted for llama and granite, Gemma's
norms stored as 1 + w, llama3 rope scaling as rope_freqs, float32 tensors, SmolLM2's tokenizer
metadata), from test_families' tiny checkpoints: our engine on the GGUF gives the same greedy
tokens, past the windows, as on the Hugging Face directory."""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tessera.config import ConfigError, SamplingParams
from tessera.models.default_model import default_model_file
from tessera.models.gguf_file import GGUFFile
from tessera.models.gguf_reader import gguf_config
from tessera.models.model_config import ModelConfig
from test_families import PROMPT, build_hf_checkpoint, engine

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

ARCHS = {"LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA, "MistralForCausalLM": gguf.MODEL_ARCH.LLAMA,
         "GraniteForCausalLM": gguf.MODEL_ARCH.GRANITE, "Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2,
         "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3, "Phi3ForCausalLM": gguf.MODEL_ARCH.PHI3,
         "Olmo2ForCausalLM": gguf.MODEL_ARCH.OLMO2, "Gemma2ForCausalLM": gguf.MODEL_ARCH.GEMMA2,
         "Gemma3ForCausalLM": gguf.MODEL_ARCH.GEMMA3}

# What a GGUF cannot say, and llama.cpp assumes instead: the converter writes Mistral as llama
# (no sliding window), and Gemma without its query scale (llama.cpp: head_dim ** -0.5) or layer
# pattern (Gemma 3: every sixth layer full). The reference directory says the same.
AS_LLAMA_CPP_RUNS_IT = {
    "mistral": {"sliding_window": None},
    "gemma2": {"query_pre_attn_scalar": 16},
    "gemma3": {"query_pre_attn_scalar": 16, "layer_types": ["sliding_attention"] * 3},
}

GGUF_MODEL_TYPE = {"mistral": "llama"}


def convert(hf_dir: Path, out: Path, tokenizer=None) -> Path:
    """The converter's output for a checkpoint, as float32 (--outtype f32); tokenizer(writer)
    writes the tokenizer.* entries (default: SmolLM2's, which the random checkpoints use)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = ARCHS[cfg["architectures"][0]]
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    _write_parameters(writer, arch, cfg)
    (tokenizer or _copy_tokenizer)(writer)
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        if arch == gguf.MODEL_ARCH.GEMMA2 and name == "lm_head.weight":
            continue
        if arch in (gguf.MODEL_ARCH.LLAMA, gguf.MODEL_ARCH.GRANITE):
            heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
            for proj, n in heads.items():
                if name.endswith((f"{proj}.weight", f"{proj}.bias")):
                    tensor = _permute(tensor, n)
        if arch in (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3) and name.endswith("norm.weight"):
            tensor = tensor + 1
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.float().numpy())
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":
        writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", _llama3_factors(cfg, rope))
    if rope.get("rope_type") == "longrope":     # Phi3MiniModel.generate_extra_tensors
        for kind in ("long", "short"):
            tensor = gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, f"ROPE_FACTORS_{kind.upper()}")] + ".weight"
            writer.add_tensor(tensor, np.array(rope[f"{kind}_factor"], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_factors(cfg: dict, rope: dict) -> np.ndarray:
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _write_parameters(w: gguf.GGUFWriter, arch, cfg: dict) -> None:
    """set_gguf_parameters of the converter's model class for `arch`."""
    heads, head_dim = cfg["num_attention_heads"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention", rope)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch == gguf.MODEL_ARCH.GEMMA2:    # Gemma2Model writes its own list (no RoPE base)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
        return
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    elif full.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(full["factor"])
        w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
    w.add_rope_freq_base(full["rope_theta"])
    if "sliding_attention" in rope:
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if "head_dim" in cfg:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch in (gguf.MODEL_ARCH.LLAMA, gguf.MODEL_ARCH.GRANITE):
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(head_dim)
    if arch == gguf.MODEL_ARCH.GRANITE:
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
    if arch == gguf.MODEL_ARCH.PHI3:
        w.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
        w.add_rope_dimension_count(head_dim)
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        if full.get("rope_type") == "longrope":
            scale = cfg["max_position_embeddings"] / cfg["original_max_position_embeddings"]
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(cfg["original_max_position_embeddings"])))
    if arch == gguf.MODEL_ARCH.GEMMA3:
        w.add_sliding_window(cfg["sliding_window"])
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])


def _copy_tokenizer(w: gguf.GGUFWriter) -> None:
    """The random checkpoints use SmolLM2's tokenizer: its GGUF's tokenizer.* entries."""
    for key, value in GGUFFile(str(default_model_file())).metadata.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_array(key, value)


def _reference(hf_dir: Path, family: str, out: Path) -> Path:
    """hf_dir, or a copy whose config.json says what llama.cpp assumes for the GGUF."""
    if family not in AS_LLAMA_CPP_RUNS_IT:
        return hf_dir
    shutil.copytree(hf_dir, out)
    cfg = json.loads((out / "config.json").read_text()) | AS_LLAMA_CPP_RUNS_IT[family]
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("family", ["llama3_rope", "mistral", "qwen2", "qwen3", "granite", "olmo2", "phi3",
                                    "phi3_longrope", "gemma2", "gemma3"])
def test_gguf_greedy_identical_to_the_hf_directory(tmp_path, family):
    hf_dir = Path(build_hf_checkpoint(family, tmp_path / "hf"))
    path = convert(hf_dir, tmp_path / f"{family}.gguf")
    ref = _reference(hf_dir, family, tmp_path / "ref")
    theirs = ModelConfig.from_hf(json.loads((ref / "config.json").read_text()))
    assert gguf_config(path) == dataclasses.replace(theirs, model_type=GGUF_MODEL_TYPE.get(family, theirs.model_type))
    # eager: recording step graphs costs seconds per engine
    expected = engine(str(ref), enforce_eager=True).generate([PROMPT], GREEDY)
    assert engine(str(path), enforce_eager=True).generate([PROMPT], GREEDY) == expected


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama3_rope_parameters_come_back_from_rope_freqs(factor):
    """Llama 3.1 (factor 8) and 3.2 (32): the converter keeps only the per-frequency divisors."""
    from tessera.models.gguf_metadata import llama3_rope
    rope = dict(rope_type="llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192)
    factors = _llama3_factors({"head_dim": 128}, dict(rope, rope_theta=500000.0))
    assert llama3_rope(factors.astype(np.float64), 500000.0, 128) == rope


def test_an_unsupported_architecture_is_a_config_error_naming_it(tmp_path):
    from tessera.models.loader import load_model
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match="GGUF architecture 'falcon' is not supported"):
        load_model(str(path))
