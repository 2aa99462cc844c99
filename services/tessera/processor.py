"""Input and output processing around the engine: prompt text or chat messages -> token ids
(the tokenizer's chat template, applied by chat_template.py), and token ids -> the text and
bytes shown in logprobs."""
from __future__ import annotations

from functools import lru_cache

from transformers import PreTrainedTokenizerBase

from tessera import chat_template
from tessera.worker_api import GenerateInput, InvalidRequest, Tokenized, TokenizeInput


class Processor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._byte_decoder = _byte_decoder() if _is_byte_level(tokenizer) else None
        self.token_bytes = lru_cache(maxsize=65536)(self._token_bytes)

    def prompt_ids(self, request: GenerateInput | TokenizeInput, add_special_tokens: bool = True) -> list[int]:
        """A request's prompt as the engine runs it (and /tokenize reports it)."""
        if getattr(request, "token_ids", None) is not None:
            return list(request.token_ids)
        if request.messages is not None:
            if self.tokenizer.chat_template is None:
                raise InvalidRequest("this model has no chat template; use /v1/completions", "messages")
            return chat_template.prompt_ids(self.tokenizer, request.messages, request.tools)
        return list(self.tokenizer(request.text or "", add_special_tokens=add_special_tokens)["input_ids"])

    def tokenize(self, request: TokenizeInput, max_model_len: int) -> Tokenized:
        ids = self.prompt_ids(request, request.add_special_tokens)
        pieces = self.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else ()
        return Tokenized(tuple(ids), tuple(pieces), max_model_len)

    def detokenize(self, token_ids: tuple[int, ...]) -> str:
        vocab = len(self.tokenizer)
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
        return self.tokenizer.decode(list(token_ids))

    def _token_bytes(self, token_id: int) -> bytes:
        if self._byte_decoder is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if piece is not None and all(ch in self._byte_decoder for ch in piece):
                return bytes(self._byte_decoder[ch] for ch in piece)
        return self.tokenizer.decode([token_id]).encode("utf-8")

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


def _is_byte_level(tokenizer: PreTrainedTokenizerBase) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and type(backend.decoder).__name__ == "ByteLevel"


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable stand-in character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}
