"""A tokenizer built from GGUF metadata, for the two tokenizer models llama.cpp files carry:

- "gpt2": byte-level BPE from the file's vocabulary and merges (SmolLM2, Llama 3, Qwen);
- "llama": SentencePiece BPE (Llama 2, Mistral, Gemma, Phi-3). The file has pieces with scores
  and no merges; SentencePiece merges the adjacent pair whose joined piece scores highest, so
  the merges are every split of a piece into two pieces, ranked by the joined piece's score.
  Spaces become "▁", a "▁" is prepended unless `add_space_prefix` is false (Gemma), and a
  character outside the vocabulary falls back to its UTF-8 byte pieces "<0xNN>".

We build the tokenizers object directly (transformers' GGUF path re-parses the whole file and
takes ~20 s for SmolLM2). Control tokens become special tokens, user-defined ones added tokens;
BOS is prepended where the file says `add_bos_token`; the chat template is the file's.
"""
from __future__ import annotations

import pathlib

from transformers import PreTrainedTokenizerFast

from tessera.config import ConfigError

# llama.cpp's token types (gguf.TokenType)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
SUPPORTED = ("gpt2", "llama")


def gguf_tokenizer(path: pathlib.Path) -> PreTrainedTokenizerFast:
    from tessera.models.gguf_file import open_gguf

    meta = open_gguf(path).metadata
    kind = meta.get("tokenizer.ggml.model")
    if kind not in SUPPORTED:
        raise ConfigError(f"{path.name}: GGUF tokenizer model {kind!r} is not supported "
                          f"(supported: {', '.join(SUPPORTED)})", "model")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    backend = _byte_level_bpe(meta, tokens) if kind == "gpt2" else _sentencepiece_bpe(meta, tokens, types)
    _add_tokens(backend, tokens, types)

    def special(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    bos = special("bos")
    if meta.get("tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None:
        from tokenizers import processors
        bos_id = tokens.index(bos)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=special("eos"),
        unk_token=special("unknown"), pad_token=special("padding"),
        chat_template=meta.get("tokenizer.chat_template"), clean_up_tokenization_spaces=False)


def _byte_level_bpe(meta: dict, tokens: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                   fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(meta: dict, tokens: list[str], types: list[int]):
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = meta.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    backend = Tokenizer(models.BPE(vocab=vocab, merges=_merges(tokens, types, scores, vocab),
                                   unk_token=tokens[unk_id] if unk_id is not None else None,
                                   fuse_unk=True, byte_fallback=True))
    # as llama.cpp: "▁" before the text and after each added token (not only at the start)
    prefix = [normalizers.Prepend("▁")] if meta.get("tokenizer.ggml.add_space_prefix", True) else []
    backend.normalizer = normalizers.Sequence(prefix + [normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                        + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend


def _merges(tokens: list[str], types: list[int], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every (left, right) split of a normal piece into two pieces of the vocabulary, the
    highest-scoring joined piece first (ties: the lower id first, as SentencePiece's order)."""
    ranked = []
    for i, (piece, kind) in enumerate(zip(tokens, types)):
        if kind != _NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_tokens(backend, tokens: list[str], types: list[int]) -> None:
    """Control tokens match as special tokens; user-defined ones as whole tokens in text."""
    from tokenizers import AddedToken

    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, types) if kind == _CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in zip(tokens, types) if kind == _USER_DEFINED])
