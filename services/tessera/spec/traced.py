"""Speculative rounds as spans (the detailed trace level), kept by spec/proposer.py's
TracedProposer on the target.

Per round of a traced request, under its worker span (tracing.worker_span):
    spec.round    from the engine's call for a tree to its next call (or to the request's end)
      spec.draft    the call: drafting here, or the round's gRPC call to the draft worker, whose
                    `spec.draft_tree` span is its child (the context rides in the call's metadata)
      spec.verify   from the tree's arrival to the next call: the target step that verified it
The proposer hears of a verification only through the next round's tokens: the emitted tokens
walk the tree it drafted (acceptance.accept's walk) to give the accepted length. A request's
last round ends at finish(), whose tokens it never sees: that round has no accepted length.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

from tessera import tracing, tracing_detail
from tessera.spec.acceptance import accept
from tessera.spec.tree import Draft


class _Round:
    def __init__(self, parent, number: int, size: int) -> None:
        from opentelemetry import trace
        self.span = tracing.tracer().start_span("spec.round", context=trace.set_span_in_context(parent), attributes={
            "tessera.spec.round": number, "tessera.spec.tree_size": size})
        self.draft: Draft | None = None
        self.drafted_at = 0.0

    def propose(self, propose: Callable[[], Draft | None], size: int) -> Draft | None:
        """propose() inside spec.draft, current in this thread (a DraftClient's call carries it)."""
        from opentelemetry import trace
        with tracing.tracer().start_as_current_span("spec.draft", context=trace.set_span_in_context(self.span)) as s:
            draft = propose()
            s.set_attribute("tessera.spec.draft_tokens", len(draft or ()))
        self.drafted_at = time.perf_counter()
        self.draft = draft if draft and len(draft) < size else None   # what the engine verifies
        return draft

    def close(self, emitted: Sequence[int] | None) -> None:
        """End the round; emitted: the tokens the target emitted since (None: the request ended)."""
        if self.draft:
            attributes = {"spec.draft_tokens": len(self.draft)}
            if emitted is not None:
                tokens = iter(emitted)
                attributes.update({"spec.accepted_tokens": len(accept(self.draft, lambda _: next(tokens, None))),
                                   "spec.emitted_tokens": len(emitted)})
            tracing_detail.StepTrace(self.span).record("spec.verify", self.drafted_at, time.perf_counter(),
                                                       **attributes)
            self.span.set_attributes({f"tessera.{k}": v for k, v in attributes.items()})
        self.span.end()


class RoundSpans:
    """The open round of every traced request of one target engine (its engine thread only)."""

    def __init__(self) -> None:
        self._open: dict[str, _Round] = {}
        self._rounds: dict[str, int] = {}

    def propose(self, propose: Callable[[], Draft | None], request_id: str, token_ids: Sequence[int],
                num_new: int, size: int) -> Draft | None:
        """Proposer.propose's arguments; propose() asks the proposer for the tree."""
        previous = self._open.pop(request_id, None)
        if previous is not None:
            previous.close(token_ids[len(token_ids) - num_new:])
        parent = tracing.worker_span(request_id)
        if parent is None:
            return propose()
        number = self._rounds[request_id] = self._rounds.get(request_id, 0) + 1
        r = _Round(parent, number, size)
        try:
            draft = r.propose(propose, size)
        except Exception as e:
            tracing.end(r.span, e)
            raise
        self._open[request_id] = r
        return draft

    def finish(self, request_id: str) -> None:
        r = self._open.pop(request_id, None)
        if r is not None:
            r.close(None)
        self._rounds.pop(request_id, None)
