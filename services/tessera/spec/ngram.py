"""Prompt-lookup drafting: guess that the text continues the way it did after an earlier
occurrence of its last few tokens (summaries quote their source, code repeats names).

No model and no state: each round looks the request's last n tokens up in its own sequence
(n from `max_n` down to `min_n`, most recent occurrences first) and merges what followed each
occurrence into one tree, so several guesses are verified in the same target forward.

min_n is 2 (vLLM's `prompt_lookup_min` plays the same role): a single repeated token says
little about what follows it, and verifying a tree of such guesses costs more than it wins
where nothing repeats: with min_n 1, chat decodes slower than without speculation
(docs/design/speculative.md#prompt-lookup; docs/benchmarks/speculative.md).
"""
from __future__ import annotations

import time
from typing import Sequence

from tessera.spec.stats import DraftStats
from tessera.spec.tree import Draft


class NgramProposer:
    """Satisfies spec/proposer.Proposer."""

    def __init__(self, max_n: int = 3, min_n: int = 2, lookback: int = 4096) -> None:
        self.max_n, self.min_n, self.lookback = max_n, min_n, lookback
        self.stats = DraftStats()

    def propose(self, request_id: str, token_ids: Sequence[int], num_new: int, size: int) -> Draft | None:
        t0 = time.perf_counter()
        seq = list(token_ids[-self.lookback:])
        tokens: list[int] = []
        parents: list[int] = []
        kids: list[dict[int, int]] = [{}]
        for start in self._continuations(seq):
            node = 0
            for t in seq[start:]:
                if len(tokens) + 1 >= size:
                    break
                nxt = kids[node].get(t)
                if nxt is None:
                    tokens.append(t), parents.append(node), kids.append({})
                    nxt = kids[node][t] = len(tokens)
                node = nxt
            if len(tokens) + 1 >= size:
                break
        self.stats.rounds += 1
        self.stats.draft_seconds += time.perf_counter() - t0
        return Draft(tuple(tokens), tuple(parents)) if tokens else None

    def _continuations(self, seq: list[int]) -> list[int]:
        """Where the text went on after earlier occurrences of its suffix, best first."""
        starts: list[int] = []
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            suffix = seq[-n:]
            for i in range(len(seq) - n - 1, -1, -1):
                if seq[i:i + n] == suffix and i + n not in starts:
                    starts.append(i + n)
        return starts

    def finish(self, request_id: str) -> None:
        pass
