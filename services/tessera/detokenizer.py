"""Incremental detokenization with stop strings, never emitting broken UTF-8.

Text grows only when the decoded tail stops ending in U+FFFD (an unfinished multi-byte
character). While a stop string could still be forming, up to len(longest stop) - 1
characters are held back, so streamed deltas always add up to the final text.
"""
from __future__ import annotations

from transformers import PreTrainedTokenizerBase

_CONTEXT_TOKENS = 5  # prompt tokens decoded ahead of the output so leading spaces come out right


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int],
                 stop: tuple[str, ...] = (), include_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop = stop
        self.include_stop = include_stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.emitted = 0
        self.stopped = False

    def append(self, token_id: int) -> bool:
        """Add one token; True when a stop string ended the text."""
        self.ids.append(token_id)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        prefix = decode(self.ids[self.prefix_offset:self.read_offset])
        full = decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += new
            return self._check_stop(len(new))
        return False

    def resume(self, output_ids, text_sent: int) -> None:
        """Continue a stream begun elsewhere: replay its output tokens, then mark the first
        text_sent characters as already delivered. The held-back rest (a partial stop string,
        an unfinished character) comes out as usual, and a stop string that spans the cut is
        found, because the replayed text is searched like any other."""
        for token_id in output_ids:
            if self.append(token_id):
                break
        self.emitted = min(text_sent, len(self.text))

    def _check_stop(self, new_len: int) -> bool:
        if not self.stop:
            return False
        search_from = max(0, len(self.text) - new_len - self.holdback)
        hits = [(self.text.find(s, search_from), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        i, s = min(hits)
        self.text = self.text[:i + len(s)] if self.include_stop else self.text[:i]
        self.stopped = True
        return True

    def delta(self, finished: bool) -> str:
        """Text not yet emitted; while running, keep back what could start a stop string."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.holdback)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
