"""Where the target engine gets its draft trees: the Proposer protocol and its in-process forms.

Each round the engine tells the proposer which tokens it emitted for a request and gets back
the subtree to verify next (docs/design/speculative.md#tree-growth). `SerialProposer` drafts
inside that call (draft, then verify, then draft: the serial baseline, and the in-process twin
of a draft worker);
`AsyncProposer` keeps expanding every request's tree on its own thread while the target
verifies and only re-roots and picks the subtree inside the call (what a draft worker runs;
rpc/draft_client.py speaks to one over gRPC and satisfies the same protocol).
"""
from __future__ import annotations

import logging
import threading
from typing import Protocol, Sequence

import torch

from tessera import tracing, tracing_detail
from tessera.config import SpeculativeConfig
from tessera.models.llama import CausalLM
from tessera.spec.draft_models import draft_model
from tessera.spec.drafter import TreeDrafter
from tessera.spec.stats import DraftStats
from tessera.spec.traced import RoundSpans
from tessera.spec.tree import Draft

log = logging.getLogger("tessera.spec")


class Proposer(Protocol):
    def propose(self, request_id: str, token_ids: Sequence[int], num_new: int, size: int) -> Draft | None:
        """token_ids: the request's whole sequence; its last token is the root (not computed by
        the target yet); the last `num_new` of them are new since this request's previous call
        (all of them on its first). Returns a subtree of at most `size` nodes, root included,
        or None (decode plainly this round)."""

    def finish(self, request_id: str) -> None:
        """Forget a request (finished, aborted, or handed to plain decoding); idempotent."""


class SerialProposer:
    """Drafts on the caller's thread: re-root, then `depth` expansions, then the subtree."""

    def __init__(self, model: CausalLM, layers: range, config: SpeculativeConfig, max_len: int) -> None:
        self.model, self.layers, self.config = model, layers, config
        self.max_len = max_len + 4 * config.width * (config.depth + 2)   # expanded nodes hold slots
        self.drafters: dict[str, TreeDrafter] = {}
        self.stats = DraftStats()

    def _sync(self, request_id: str, token_ids: Sequence[int], num_new: int) -> TreeDrafter:
        d = self.drafters.get(request_id)
        if d is None or num_new >= len(token_ids):
            d = self.drafters[request_id] = TreeDrafter(self.model, self.layers, self.max_len, self.config.width,
                                                                self.config.branching)
            d.start(list(token_ids))
        else:
            self.stats.hits += d.reroot(list(token_ids[-num_new:]))
        self.stats.rounds += 1
        return d

    def propose(self, request_id: str, token_ids: Sequence[int], num_new: int, size: int) -> Draft | None:
        import time
        t0 = time.perf_counter()
        d = self._sync(request_id, token_ids, num_new)
        for _ in range(self.config.depth):
            self.stats.expansions += bool(d.expand())
        while len(d.tree) < size and d.expand():
            self.stats.expansions += 1
            self.stats.topups += 1
        self.stats.draft_seconds += time.perf_counter() - t0
        return d.draft(size)

    def finish(self, request_id: str) -> None:
        d = self.drafters.pop(request_id, None)
        if d is not None:
            self.stats.wasted_nodes += d.wasted


class AsyncProposer(SerialProposer):
    """A draft worker's heart: a thread expands every live request's tree (up to `depth`
    expansions past the last round, the paper's d) while the target verifies; a round only
    re-roots, tops the tree up to `size` if it is short, and picks the subtree. A round made in
    a recording span (the draft worker's spec.draft_tree) has the expansions after it recorded
    under that span as spec.expand: drafting beside the target's verification."""

    def __init__(self, model: CausalLM, layers: range, config: SpeculativeConfig, max_len: int) -> None:
        super().__init__(model, layers, config, max_len)
        self._lock = threading.Condition()
        self._rounds_waiting = 0        # rounds blocked on the lock: the expander yields to them
        self._count_lock = threading.Lock()
        self._budget: dict[str, int] = {}
        self._traces: dict[str, tracing_detail.StepTrace] = {}   # request id -> its last round's span
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="draft-expand", daemon=True)
        self._thread.start()

    def propose(self, request_id: str, token_ids: Sequence[int], num_new: int, size: int) -> Draft | None:
        with self._count_lock:
            self._rounds_waiting += 1
        with self._lock:
            with self._count_lock:
                self._rounds_waiting -= 1
            d = self._sync(request_id, token_ids, num_new)
            while len(d.tree) < size and d.expand():   # the paper tops a short tree up at once
                self.stats.expansions += 1
                self.stats.topups += 1
            self._budget[request_id] = self.config.depth
            trace = tracing_detail.current()
            if trace is not None:
                self._traces[request_id] = trace
            elif self._traces:
                self._traces.pop(request_id, None)
            self._lock.notify()
            return d.draft(size)

    def finish(self, request_id: str) -> None:
        with self._lock:
            self._budget.pop(request_id, None)
            self._traces.pop(request_id, None)
            super().finish(request_id)

    @property
    def alive(self) -> bool:
        """False once the expansion thread has died (the draft worker's health reports it)."""
        return self._thread.is_alive()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        import time
        while True:
            with self._lock:
                while not self._closed and (self._rounds_waiting or not any(self._budget.values())):
                    self._lock.wait(0.05)
                if self._closed:
                    return
                rid = max(self._budget, key=self._budget.__getitem__)
                t0 = time.perf_counter()
                try:
                    grew = self.drafters[rid].expand()
                except Exception:    # one request's draft fails alone (its next round restarts it)
                    log.exception("request %s: draft expansion failed", rid)
                    self.drafters.pop(rid, None)
                    self._budget.pop(rid, None)
                    self._traces.pop(rid, None)
                    continue
                t1 = time.perf_counter()
                self.stats.draft_seconds += t1 - t0
                trace = self._traces.get(rid)
                if trace is not None:
                    try:
                        trace.record("spec.expand", t0, t1, **{"spec.expanded_nodes": grew})
                    except Exception:    # a span that cannot be made must not end the drafting
                        log.exception("request %s: its expansion's span failed", rid)
                self.stats.expansions += bool(grew)
                self._budget[rid] = self._budget[rid] - 1 if grew else 0
                if self._rounds_waiting:
                    self._lock.wait(0.001)     # hand the lock to a waiting round (locks are not fair)


def make_proposer(config: SpeculativeConfig, target: CausalLM | None, dtype: torch.dtype,
                  max_len: int) -> Proposer | None:
    """The proposer a target engine uses: none, a draft worker over gRPC (disaggregated), or
    the draft model in this process (serial); its rounds are spans at the detailed trace level
    (spec/traced.py)."""
    return traced(_proposer(config, target, dtype, max_len))


class TracedProposer:
    """`inner`'s rounds, each a span tree (spec/traced.py)."""

    def __init__(self, inner: Proposer) -> None:
        self.inner, self.spans = inner, RoundSpans()

    def propose(self, request_id: str, token_ids: Sequence[int], num_new: int, size: int) -> Draft | None:
        return self.spans.propose(lambda: self.inner.propose(request_id, token_ids, num_new, size),
                                  request_id, token_ids, num_new, size)

    def finish(self, request_id: str) -> None:
        self.spans.finish(request_id)
        self.inner.finish(request_id)


def traced(proposer: Proposer | None) -> Proposer | None:
    """The proposer, wrapped when this process traces at the detailed level."""
    return TracedProposer(proposer) if proposer is not None and tracing.detailed() else proposer


def _proposer(config: SpeculativeConfig, target: CausalLM | None, dtype: torch.dtype,
              max_len: int) -> Proposer | None:
    if config.draft is None:
        return None
    if config.draft == "ngram":
        from tessera.spec.ngram import NgramProposer
        return NgramProposer()
    if config.draft_address:
        from tessera.rpc.draft_client import DraftClient
        return DraftClient(config.draft_address, vocab_size=target.config.vocab_size if target else None)
    model, layers = draft_model(config.draft, target, dtype)
    return SerialProposer(model, layers, config, max_len)
