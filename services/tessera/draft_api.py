"""The draft worker boundary as plain dataclasses: one round of one request, as the target's
DraftClient (rpc/draft_client.py) sends it and the draft worker's DraftRounds
(rpc/draft_server.py) checks it; the reply is a spec.tree.Draft. rpc/convert.py maps these to
and from protobuf (draft.proto)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DraftRound:
    request_id: str
    round: int                      # increases with every round of a request
    token_ids: tuple[int, ...]      # new since the request's previous round, or all of them
    num_tokens: int                 # the request's whole length, these tokens included
    size: int                       # at most this many tree nodes, root included


@dataclass(frozen=True)
class DraftInfo:
    model_id: str                   # the target model it drafts for
    layers: int                     # layers the draft runs (K of a self:K draft)
    vocab_size: int
    max_len: int                    # longest sequence a round may carry
    requests: int = 0               # requests with draft state
    rounds: int = 0                 # rounds answered
    refused: int = 0                # rounds refused (malformed or out of sync), never applied
    role: str = "draft"


class RoundRefused(ValueError):
    """A round the draft worker does not apply. out_of_sync: it does not continue the request's
    state there (unknown request, stale round, wrong length), and resending the whole sequence
    fixes it (FAILED_PRECONDITION); otherwise the round is malformed (INVALID_ARGUMENT)."""

    def __init__(self, message: str, out_of_sync: bool = False) -> None:
        super().__init__(message)
        self.out_of_sync = out_of_sync
