"""The draft worker's side of draft.proto. DraftRounds keeps, per request, the sequence its
proposer (spec.proposer.AsyncProposer) holds and the request's last round, and checks every
round against them before the proposer sees it; DraftServicer puts it on gRPC. A refused round
changes nothing and is counted; a round the proposer fails on forgets the request (its next
round must carry the whole sequence). No round can crash the worker."""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
from dataclasses import dataclass, replace

import grpc

from tessera import tracing
from tessera.draft_api import DraftInfo, DraftRound, RoundRefused
from tessera.rpc import convert
from tessera.rpc.v1 import draft_pb2, draft_pb2_grpc
from tessera.spec.proposer import Proposer
from tessera.spec.stats import DraftStats
from tessera.spec.tree import Draft

log = logging.getLogger("tessera.draft_worker")
MAX_TREE = 1024          # a bigger tree is a malformed round, not minutes of drafting
MAX_ID_LEN = 256


@dataclass
class _Session:
    round: int
    tokens: list[int]        # exactly what the proposer was last synced with for this request


class DraftRounds:
    """Thread-safe; one round at a time (the proposer drafts under its own lock anyway).
    At most max_requests requests keep state: a new one evicts the least recently used,
    whose next round then comes back out of sync (so a target that died never leaks state)."""

    def __init__(self, proposer: Proposer, info: DraftInfo, max_requests: int = 256,
                 stats: DraftStats | None = None) -> None:
        """stats: the proposer's drafting counters, for /metrics."""
        self.proposer, self.info_base, self.max_requests, self.stats = proposer, info, max_requests, stats
        self._sessions: collections.OrderedDict[str, _Session] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.rounds = 0
        self.refused: collections.Counter[str] = collections.Counter()   # "malformed" / "out_of_sync"

    def round(self, r: DraftRound) -> Draft:
        """The subtree to verify next (at most r.size nodes, root included); RoundRefused when
        the round is malformed or does not continue this request's state here."""
        with self._lock:
            try:
                tokens, num_new = self._check(r)
            except RoundRefused as e:
                self.refused["out_of_sync" if e.out_of_sync else "malformed"] += 1
                raise
            try:
                draft = self.proposer.propose(r.request_id, tokens, num_new, r.size)
            except Exception:
                self._forget(r.request_id)
                raise
            self._sessions[r.request_id] = _Session(r.round, tokens)
            self._sessions.move_to_end(r.request_id)
            while len(self._sessions) > self.max_requests:
                self._forget(next(iter(self._sessions)))
            self.rounds += 1
            return draft or Draft((), ())

    def _check(self, r: DraftRound) -> tuple[list[int], int]:
        """(the request's whole sequence after this round, how many of its tokens are new)."""
        i = self.info_base
        if not r.request_id or len(r.request_id) > MAX_ID_LEN:
            raise RoundRefused(f"request_id must be 1 to {MAX_ID_LEN} characters")
        if not 1 <= r.size <= MAX_TREE:
            raise RoundRefused(f"size must be in [1, {MAX_TREE}], got {r.size}")
        if not r.token_ids:
            raise RoundRefused("a round carries at least one new token")
        if any(not 0 <= t < i.vocab_size for t in r.token_ids):
            raise RoundRefused(f"token ids must be in [0, {i.vocab_size})")
        if r.num_tokens > i.max_len:
            raise RoundRefused(f"{r.num_tokens} tokens exceed the draft's {i.max_len}")
        s = self._sessions.get(r.request_id)
        if len(r.token_ids) == r.num_tokens:
            # The whole sequence (re)starts the request whatever its round: a restarted target
            # counts rounds from 1 again. One that continues what is held (the target lost a
            # reply, or backed off) keeps the tree.
            new = list(r.token_ids)
            held = len(s.tokens) if s is not None and new[:len(s.tokens)] == s.tokens else 0
            return new, (r.num_tokens - held if 0 < held < r.num_tokens else r.num_tokens)
        if s is None:
            raise RoundRefused("unknown request: send the whole sequence", out_of_sync=True)
        if r.round <= s.round:
            raise RoundRefused(f"round {r.round} is not after round {s.round}", out_of_sync=True)
        if len(s.tokens) + len(r.token_ids) != r.num_tokens:
            raise RoundRefused(f"holds {len(s.tokens)} tokens; {len(r.token_ids)} more are not {r.num_tokens}",
                               out_of_sync=True)
        return s.tokens + list(r.token_ids), len(r.token_ids)

    def finish(self, request_id: str) -> None:
        with self._lock:
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self._sessions.pop(request_id, None)
        self.proposer.finish(request_id)

    def info(self) -> DraftInfo:
        return replace(self.info_base, requests=len(self._sessions), rounds=self.rounds,
                       refused=sum(self.refused.values()))


class DraftServicer(draft_pb2_grpc.DraftWorkerServicer):
    """grpc.aio: a round drafts on a worker thread so the event loop keeps answering."""

    def __init__(self, rounds: DraftRounds) -> None:
        self.rounds = rounds

    async def Round(self, request, context):
        """A round whose call carries a traceparent (the target traces it) is a spec.draft_tree
        span, child of the target's spec.draft."""
        r = convert.round_from_proto(request)
        with tracing.rpc_span("spec.draft_tree", context.invocation_metadata(), **{
                "spec.new_tokens": len(r.token_ids), "spec.tree_size": r.size}) as span:
            try:
                draft = await asyncio.to_thread(self.rounds.round, r)
            except RoundRefused as e:
                await context.abort(*convert.refusal_to_status(e))
            except Exception as e:      # the proposer failed: this round only, never the worker
                log.exception("request %s: round %d failed", r.request_id, r.round)
                await context.abort(grpc.StatusCode.INTERNAL, f"drafting failed: {type(e).__name__}: {e}")
            if span is not None:
                span.set_attribute("tessera.spec.draft_tokens", len(draft))
        return convert.draft_to_proto(r.round, draft)

    async def Finish(self, request, context):
        await asyncio.to_thread(self.rounds.finish, request.request_id)
        return draft_pb2.FinishReply()

    async def Info(self, request, context):
        return convert.draft_info_to_proto(self.rounds.info())
