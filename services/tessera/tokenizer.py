"""Tokenizers: a Hugging Face directory's own, or one built from GGUF metadata
(models/gguf_tokenizer.py)."""
from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tessera.models.gguf_tokenizer import gguf_tokenizer
from tessera.models.loader import resolve_model_path

__all__ = ["gguf_tokenizer", "load_tokenizer", "user_message_ids"]


def load_tokenizer(model: str) -> PreTrainedTokenizerBase:
    path = resolve_model_path(model)
    if path.suffix == ".gguf":
        return gguf_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


def user_message_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """One user message as a chat request sends it: through the chat template (with the
    assistant's turn opened) where the tokenizer has one, else the raw text."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(text)
