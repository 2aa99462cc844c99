"""The model as a Hugging Face directory, the form vLLM loads: an HF directory is used as it is;
a GGUF file (the default 'smollm2') is converted once into $TESSERA_CACHE/models/hf-<stem>
(config.json, model.safetensors with the dequantized float32 weights our own loader reads, and
the tokenizer Tessera builds from the GGUF), so both engines serve the very same weights.
Nothing is downloaded."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile

from tessera.config import ConfigError
from tessera.models.loader import iter_checkpoint, load_config, resolve_model_path
from tessera.models.model_config import ModelConfig


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("TESSERA_CACHE", "~/.cache/tessera")).expanduser() / "models"


def hf_directory(model: str) -> pathlib.Path:
    """The HF directory for `model` (a path, 'smollm2' or random:ARCH), converting a GGUF file
    on first use; written atomically (a temp dir renamed), so concurrent workers are safe."""
    from tessera.models import quantized_checkpoint
    path = resolve_model_path(model)
    if path.is_dir():
        if quantized_checkpoint.is_quantized_checkpoint(path):
            raise ConfigError("the vLLM engine does not load Tessera's quantized checkpoints", "model")
        return path
    stat = path.stat()
    out = cache_dir() / f"hf-{path.stem}-{stat.st_size:x}"
    if not (out / "config.json").exists():
        _write(path, model, out)
    return out


def _write(gguf: pathlib.Path, model: str, out: pathlib.Path) -> None:
    import torch
    from safetensors.torch import save_file

    from tessera.tokenizer import load_tokenizer
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        tensors = {name: read().to(torch.float32).contiguous() for name, read in iter_checkpoint(gguf)}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        load_tokenizer(model).save_pretrained(str(tmp))
        (tmp / "config.json").write_text(json.dumps(hf_config(load_config(gguf)), indent=2))
        tmp.rename(out)   # config.json appears with everything else, or not at all
    except OSError:
        if not (out / "config.json").exists():   # not a lost race: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def hf_config(cfg: ModelConfig) -> dict:
    """A transformers LlamaForCausalLM config.json for a Llama-family ModelConfig."""
    if cfg.arch != "llama":
        raise ConfigError(f"converting a {cfg.arch} GGUF for vLLM is not supported (llama only)", "model")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.qkv_bias, "mlp_bias": False,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids),
        "torch_dtype": "float32",
    }
