"""Incremental detokenization with stop strings, never emitting broken UTF-8.

Text grows only when the decoded tail stops ending in U+FFFD (an unfinished multi-byte
character). While a stop string could still be forming, up to len(longest stop) - 1
characters are held back, so streamed deltas always add up to the final text.

Cost: every decode covers a window of at most 2 * MAX_PENDING tokens, so a step costs O(1)
whatever the model emits. Special tokens (which decoding skips) never enter the window, and
a run of more than MAX_PENDING tokens that still ends in U+FFFD (bytes that are no UTF-8,
which no well-formed text produces) is emitted as it decodes, replacement characters and all,
instead of being re-decoded on every step until a valid character follows.
"""
from __future__ import annotations

import functools

from transformers import PreTrainedTokenizerBase

_CONTEXT_TOKENS = 5  # prompt tokens decoded ahead of the output so leading spaces come out right
MAX_PENDING = 16     # tokens held undecided at most (a UTF-8 character spans up to 4 byte tokens)


@functools.lru_cache(maxsize=8)
def skipped_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Ids that decode(..., skip_special_tokens=True) drops before decoding the rest: the
    special tokens that decode to nothing on their own. Leaving them out of the window changes
    no text."""
    special = set(tokenizer.all_special_ids)
    special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    return frozenset(i for i in special if tokenizer.decode([i], skip_special_tokens=True) == "")


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int],
                 stop: tuple[str, ...] = (), include_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skipped = skipped_ids(tokenizer)
        # The window: ids[:read_offset] is context already turned into text (prefix_text),
        # ids[read_offset:] the tokens whose text is still undecided.
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.read_offset = len(self.ids)
        self.prefix_text = self._decode(self.ids)
        self.text = ""
        self.stop = stop
        self.include_stop = include_stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.emitted = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def append(self, token_id: int) -> bool:
        """Add one token; True when a stop string ended the text."""
        if token_id in self.skipped:
            return False
        self.ids.append(token_id)
        full = self._decode(self.ids)
        pending = len(self.ids) - self.read_offset
        if len(full) > len(self.prefix_text) and (not full.endswith("\ufffd") or pending >= MAX_PENDING):
            new = full[len(self.prefix_text):]
            self._settle()
            self.text += new
            return self._check_stop(len(new))
        if pending >= MAX_PENDING:   # tokens that add no text: they become context
            self._settle()
        return False

    def _settle(self) -> None:
        """The undecided tokens are text now: they become the next window's context."""
        self.ids = self.ids[self.read_offset:]
        self.read_offset = len(self.ids)
        self.prefix_text = self._decode(self.ids)

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
