"""Tokenizers: a Hugging Face directory's own, or one built from GGUF metadata
(models/gguf_tokenizer.py)."""
from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tessera.models.gguf_tokenizer import gguf_tokenizer
from tessera.models.loader import resolve_model_path

__all__ = ["gguf_tokenizer", "load_tokenizer"]


def load_tokenizer(model: str) -> PreTrainedTokenizerBase:
    path = resolve_model_path(model)
    if path.suffix == ".gguf":
        return gguf_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))
