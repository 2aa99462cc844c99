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
