"""DraftClient: the target engine's side of draft.proto, a spec.proposer.Proposer.

It is called on the engine loop thread (one caller), so every call is bounded: a round waits
at most timeout_s. Per request it remembers how many tokens the draft worker holds and sends
only the new ones. Any failure raises, which the engine takes as "no draft this round" (plain
decoding), and forgets the request, so its next round resends the whole sequence. After the
draft worker could not be reached (or failed a round), rounds raise at once for a back-off that
doubles with each consecutive failure (backoff_s up to max_backoff_s): a dead draft worker
costs one timeout, not one per step; then it is tried again, and speculation resumes as soon
as it answers. At the detailed trace level a round's call carries the W3C context of the span
current on the engine thread (spec/traced.py's spec.draft) as gRPC metadata.
"""
from __future__ import annotations

import itertools
import time
from typing import Sequence

import grpc

from tessera import mtls, tracing
from tessera.draft_api import DraftInfo, DraftRound
from tessera.rpc import convert, options
from tessera.rpc.v1 import draft_pb2, draft_pb2_grpc
from tessera.spec.tree import Draft

# The draft worker answered and refused this round: only this request is out of step.
_REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)


class DraftUnavailable(RuntimeError):
    """No draft this round: the draft worker is unreachable, failed, refused or backing off."""


class DraftClient:
    def __init__(self, address: str, timeout_s: float = 1.0, backoff_s: float = 1.0,
                 max_backoff_s: float = 8.0, vocab_size: int | None = None) -> None:
        """vocab_size: the target's; a draft holding a token outside it is refused (a draft
        model with another tokenizer must not reach the target's embedding)."""
        self.address, self.timeout_s = address, timeout_s
        self.backoff_s, self.max_backoff_s, self.vocab_size = backoff_s, max_backoff_s, vocab_size
        self._channel = mtls.channel(address, "draft-worker", options.RECONNECT)
        self._stub = draft_pb2_grpc.DraftWorkerStub(self._channel)
        self._held: dict[str, int] = {}          # request id -> tokens the draft worker holds
        self._rounds = itertools.count(1)        # one counter: rounds increase per request, across resets
        self._failures = 0
        self._retry_at = 0.0
        self._finishing: set[grpc.Future] = set()   # held until done: gRPC cancels a collected future
        self.failed_rounds = 0

    def propose(self, request_id: str, token_ids: Sequence[int], num_new: int, size: int) -> Draft | None:
        """Proposer.propose over gRPC; raises DraftUnavailable instead of returning a draft it
        cannot trust (a stale round, a malformed tree, a token outside the vocabulary)."""
        held = self._held.pop(request_id, None)  # forgotten unless this round succeeds
        if time.monotonic() < self._retry_at:
            raise DraftUnavailable(f"draft worker {self.address} failed recently; retrying in "
                                   f"{self._retry_at - time.monotonic():.1f} s")
        n = len(token_ids)
        delta = held is not None and 0 < num_new < n and held == n - num_new
        r = DraftRound(request_id, next(self._rounds), tuple(token_ids[n - num_new:] if delta else token_ids), n, size)
        try:
            reply = self._stub.Round(convert.round_to_proto(r), timeout=self.timeout_s,
                                     metadata=tracing.outgoing_metadata())   # the round's span, when traced
            answered, draft = convert.draft_from_proto(reply)
        except grpc.RpcError as e:
            self.failed_rounds += 1
            if e.code() not in _REFUSED:
                self._back_off()
            raise DraftUnavailable(f"draft worker {self.address}: {e.code().name}: {e.details()}") from None
        except ValueError as e:
            raise DraftUnavailable(f"draft worker {self.address} sent a malformed tree: {e}") from None
        self._check(r, answered, draft)
        self._failures = 0
        self._held[request_id] = n
        return draft or None

    def _check(self, r: DraftRound, answered: int, draft: Draft) -> None:
        if answered != r.round:
            raise DraftUnavailable(f"stale draft: round {answered} answered for round {r.round}")
        if len(draft) >= r.size:
            raise DraftUnavailable(f"a draft of {len(draft)} + 1 nodes exceeds the {r.size} asked for")
        if self.vocab_size is not None and any(not 0 <= t < self.vocab_size for t in draft.tokens):
            raise DraftUnavailable(f"a draft token is outside the vocabulary of {self.vocab_size}")

    def _back_off(self) -> None:
        """The draft worker may have restarted and lost every request: resend them whole."""
        self._failures += 1
        self._retry_at = time.monotonic() + min(self.max_backoff_s, self.backoff_s * 2 ** (self._failures - 1))
        self._held.clear()

    def finish(self, request_id: str) -> None:
        """Proposer.finish: a Finish the call does not wait for, sent only for a request the
        draft worker holds (the engine calls finish on every step it decodes plainly)."""
        if self._held.pop(request_id, None) is None or time.monotonic() < self._retry_at:
            return
        call = self._stub.Finish.future(draft_pb2.FinishRequest(request_id=request_id), timeout=self.timeout_s)
        self._finishing.add(call)
        call.add_done_callback(self._finishing.discard)

    def info(self, timeout_s: float = 5.0) -> DraftInfo:
        """The draft worker's model and counters; grpc.RpcError when it does not answer."""
        return convert.draft_info_from_proto(self._stub.Info(draft_pb2.DraftInfoRequest(), timeout=timeout_s))

    def close(self) -> None:
        self._channel.close()
