"""A tokenizer built from GGUF metadata.

We build the byte-level BPE directly from the vocabulary and merges in the file
(transformers' GGUF path re-parses the whole file and takes ~20 s for SmolLM2); control tokens
become special tokens and the chat template comes from tokenizer.chat_template.
"""
from __future__ import annotations

import pathlib

from transformers import PreTrainedTokenizerFast

_CONTROL = 3


def gguf_tokenizer(path: pathlib.Path) -> PreTrainedTokenizerFast:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from tessera.models.gguf_file import open_gguf

    meta = open_gguf(path).metadata
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"GGUF tokenizer {meta.get('tokenizer.ggml.model')!r} is not supported (gpt2 only)")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                   fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or []
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, types) if kind == _CONTROL])

    def special(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[token_id] if token_id is not None else None

    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=special("bos"), eos_token=special("eos"),
        unk_token=special("unknown"), pad_token=special("padding"),
        chat_template=meta.get("tokenizer.chat_template"), clean_up_tokenization_spaces=False)
