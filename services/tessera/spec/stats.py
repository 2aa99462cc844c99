"""Speculation counters, plain data: the draft side's (DraftStats, per proposer) and the
target side's (SpecStats, per engine); metrics.py exports both."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DraftStats:
    """What /metrics reports about drafting (counters since start)."""
    rounds: int = 0
    hits: int = 0
    expansions: int = 0
    topups: int = 0                  # expansions a round waited for (its tree was short of bs)
    wasted_nodes: int = 0
    draft_seconds: float = 0.0


@dataclass
class SpecStats:
    """Tree verification counters since start (exported as metrics): acceptance length is
    emitted / verify_rounds."""
    verify_rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0

    def count(self, drafted: int, accepted: int, emitted: int) -> None:
        self.verify_rounds += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.emitted_tokens += emitted

    @property
    def acceptance_length(self) -> float:
        return self.emitted_tokens / self.verify_rounds if self.verify_rounds else 0.0
