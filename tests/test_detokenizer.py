"""Incremental detokenization: never broken UTF-8, deltas add up, stop strings held back."""
from __future__ import annotations

from tessera.detokenizer import IncrementalDetokenizer
from tessera.tokenizer import load_tokenizer

TOKENIZER = None


def tok():
    global TOKENIZER
    TOKENIZER = TOKENIZER or load_tokenizer("smollm2")
    return TOKENIZER


def stream(text: str, stop=(), include=False) -> tuple[list[str], str]:
    t = tok()
    ids = t(text)["input_ids"]
    d = IncrementalDetokenizer(t, [1], stop, include)
    deltas = []
    for i, token in enumerate(ids):
        stopped = d.append(token)
        deltas.append(d.delta(finished=stopped or i == len(ids) - 1))
        if stopped:
            break
    return deltas, d.text


def test_emoji_and_cjk_deltas_are_whole_characters():
    text = "Hi 😀👍🏽 世界和平 — naïve café 🇫🇷!"
    deltas, full = stream(text)
    assert "".join(deltas) == full == text
    for piece in deltas:
        piece.encode("utf-8")  # raises on lone surrogates
        assert "\ufffd" not in piece


def test_stop_string_cut_and_held_back():
    deltas, full = stream("alpha beta STOP gamma", stop=("STOP",))
    assert full == "alpha beta " and "".join(deltas) == full
    deltas, full = stream("alpha beta STOP gamma", stop=("STOP",), include=True)
    assert full == "alpha beta STOP"


class CountingTokenizer:
    """The tokenizer, counting decode calls and the token ids they decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.calls, self.decoded = tokenizer, 0, 0

    def decode(self, ids, **kwargs):
        self.calls += 1
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_special_tokens_and_undecodable_bytes_cost_constant_decoding_per_token():
    """A legal generation of 1500 special tokens (skipped when decoding) and then 1500 tokens
    of a lone UTF-8 continuation byte (U+FFFD until valid text follows): re-decoding the whole
    undecided tail on every step would cost about n^2 / 2 token decodes on the engine thread.
    Each token costs a bounded number of decoded ids, and the text is still exactly what
    decoding everything at once gives."""
    t = tok()
    special = t.convert_tokens_to_ids("<|im_start|>")
    byte = next(i for i in range(t.vocab_size) if t.decode([i]) == "\ufffd")   # e.g. the byte 0x80
    words = t(" the end")["input_ids"]
    output = t(" Hello")["input_ids"] + [special] * 1500 + words + [byte] * 1500 + words
    counting = CountingTokenizer(t)
    d = IncrementalDetokenizer(counting, [1, 2, 3])
    deltas = []
    for token in output:
        d.append(token)
        deltas.append(d.delta(finished=False))
    deltas.append(d.delta(finished=True))
    assert "".join(deltas) == d.text == t.decode(output, skip_special_tokens=True)
    assert d.text.count("\ufffd") == 1500
    assert counting.calls <= 2 * len(output) + 2
    assert counting.decoded <= 40 * len(output), counting.decoded
