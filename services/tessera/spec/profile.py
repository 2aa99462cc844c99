"""Measurements that feed spec/simulator.py, taken on this machine: t_target(bs) as whole engine
steps verifying a fixed bs-node tree, t_draft(w) as one tree expansion of w leaves, the cost
of a miss (forwarding verified tokens the tree lacked) and of a round's draft bookkeeping;
plus the timed greedy generation every bench mode runs. Placement (cores, torch threads) is
the caller's: see `placed`.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from tessera.config import SamplingParams
from tessera.spec.drafter import TreeDrafter
from tessera.spec.simulator import Shape, SpecProfile
from tessera.spec.tree import Draft


def two_cores() -> tuple[int, int]:
    """The first two cores this process may use (the same one twice on a one-core machine)."""
    cores = sorted(os.sched_getaffinity(0))
    return cores[0], cores[min(1, len(cores) - 1)]


@contextlib.contextmanager
def placed(cores: set[int], threads: int):
    """Run the block on `cores` (this thread; torch's pool threads were created on both cores
    before any placement, see `warm_thread_pool`) with `threads` torch threads, then restore."""
    before_cores, before_threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before_cores)
        torch.set_num_threads(before_threads)


def warm_thread_pool(threads: int = 2) -> None:
    """Create torch's intra-op threads while this process may use every core: a pool thread
    inherits the affinity of the thread that starts it, so one started inside a one-core
    placement would stay on that core."""
    torch.set_num_threads(threads)
    with torch.inference_mode():
        (torch.ones(256, 256) @ torch.ones(256, 256)).sum()


@dataclass
class Run:
    """One timed greedy generation of a single request (batch 1)."""
    tokens: list[int]
    ttft_s: float
    step_s: list[float] = field(default_factory=list)     # each step after the first (prefill)
    per_round: list[int] = field(default_factory=list)    # tokens each of those steps emitted
    nodes: list[int] = field(default_factory=list)        # tree size each of them verified (1: plain)

    @property
    def tpot_ms(self) -> float:
        return 1e3 * sum(self.step_s) / max(len(self.tokens) - 1, 1)

    @property
    def tok_s(self) -> float:
        """Decode speed: tokens after the first / time after the first (TTFT excluded)."""
        return (len(self.tokens) - 1) / sum(self.step_s) if self.step_s else 0.0

    @property
    def acceptance_length(self) -> float:
        return sum(self.per_round) / len(self.per_round) if self.per_round else 0.0


def timed_generate(engine, prompt: list[int], max_tokens: int) -> Run:
    """Greedy, EOS ignored (every mode emits exactly max_tokens); each engine step is one
    speculation round (or one plain decode step)."""
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    run: Run | None = None
    while engine.has_unfinished:
        drafted = engine.spec_stats.draft_tokens
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        emitted = [t for o in outs for t in o.new_token_ids]
        if run is None:
            run = Run(emitted, dt)
        else:
            run.tokens += emitted
            run.step_s.append(dt)
            run.per_round.append(len(emitted))
            run.nodes.append(1 + engine.spec_stats.draft_tokens - drafted)
    assert run is not None
    return run


class FixedProposer:
    """A Proposer that always offers the same bs-node chain of one token: it fixes the
    verification's shape for timing (the draft is almost never accepted)."""

    def __init__(self, bs: int, token: int = 0) -> None:
        self.draft = Draft((token,) * (bs - 1), tuple(range(bs - 1)))

    def propose(self, request_id, token_ids, num_new, size) -> Draft | None:
        return self.draft

    def finish(self, request_id: str) -> None:
        pass


def target_times(make_engine, prompt: list[int], sizes: Sequence[int], steps: int) -> dict[int, float]:
    """bs -> median seconds of an engine step verifying a bs-node tree (bs = 1: a plain decode
    step). make_engine(proposer or None) builds an engine on the shared weights."""
    out = {}
    for bs in sizes:
        engine = make_engine(FixedProposer(bs) if bs > 1 else None)
        timed_generate(engine, prompt[:8], 2)                       # warm-up
        run = timed_generate(engine, prompt, steps + 2)
        out[bs] = statistics.median(run.step_s[1:])                 # the first after prefill warms caches
    return out


def draft_times(model, layers: range, prompt: list[int], widths: Sequence[int], reps: int) -> dict[int, float]:
    """w -> median seconds of one expansion of w leaves, after the prompt's prefill."""
    out = {}
    for w in widths:
        d = TreeDrafter(model, layers, len(prompt) + (reps + 2) * w + 1, w)
        d.start(prompt)
        d.expand()                                                  # prefill + the root
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            d.expand()
            samples.append(time.perf_counter() - t0)
        out[w] = statistics.median(samples)
    return out


def round_and_miss_times(model, layers: range, prompt: list[int], shape: Shape, t_draft1: float,
                         reps: int) -> tuple[float, float]:
    """(t_round, t_prefix_flush), medians. t_round: a hit's re-root (KV gather) and the subtree
    pick. t_prefix_flush: after a miss whose one verified token the tree lacked, the next
    expansion (that token's forward + the new root's) minus t_draft(1)."""
    rounds, flushes = [], []
    for _ in range(reps):
        d = TreeDrafter(model, layers, len(prompt) + (shape.d + 4) * shape.w + 4, shape.w)
        d.start(prompt)
        for _ in range(max(shape.d, 2)):
            d.expand()
        t0 = time.perf_counter()
        d.reroot([d.tree.tokens[1]])                                # node 1: the root's best child
        d.draft(shape.bs)
        rounds.append(time.perf_counter() - t0)
        absent = [t for t in range(len(d.tree.kids[0]) + 2) if t not in d.tree.kids[0]][:2]
        d.reroot(absent)                                            # a miss: absent[0] must be forwarded
        t0 = time.perf_counter()
        d.expand()
        flushes.append(time.perf_counter() - t0)
    return statistics.median(rounds), max(statistics.median(flushes) - t_draft1, 0.0)


def measure_target(make_engine, prompt: list[int], bs: int, steps: int,
                   place: tuple[set[int], int]) -> dict[int, float]:
    """t_target at bs = 1, 2, 4, 8, 16 up to the configured bs, and at bs, on place = (cores,
    threads). Not beyond bs: the engine does not verify a tree larger than its tree size (it
    decodes plainly), so such a point would time a plain step."""
    with placed(*place):
        return target_times(make_engine, prompt, sorted({n for n in (1, 2, 4, 8, 16) if n <= bs} | {bs}), steps)


def measure_draft(model, layers: range, prompt: list[int], shape: Shape, steps: int,
                  place: tuple[set[int], int]) -> tuple[dict[int, float], float, float]:
    """(t_draft by w = 1, 2, 4, 8 and the configured w, t_round, t_prefix_flush) on place."""
    with placed(*place):
        t_draft = draft_times(model, layers, prompt, sorted({1, 2, 4, 8, shape.w}), steps)
        t_round, t_flush = round_and_miss_times(model, layers, prompt, shape, t_draft[1], max(steps // 2, 2))
    return t_draft, t_round, t_flush


def lookup_round_s(prompt: list[int], bs: int, reps: int) -> float:
    """A model-free drafter's round (prompt lookup, 'ngram'): median seconds of one proposal."""
    from tessera.spec.ngram import NgramProposer
    proposer, samples = NgramProposer(), []
    for _ in range(reps):
        t0 = time.perf_counter()
        proposer.propose("profile", prompt, len(prompt), bs)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def profile_ms(p: SpecProfile) -> dict:
    """A profile for JSON, in milliseconds."""
    ms = lambda t: round(1e3 * t, 3)  # noqa: E731
    return {"t_target_ms": {bs: ms(t) for bs, t in sorted(p.t_target.items())},
            "t_draft_ms": {w: ms(t) for w, t in sorted(p.t_draft.items())},
            "t_prefix_flush_ms": ms(p.t_prefix_flush), "t_round_ms": ms(p.t_round), "t_comm_ms": ms(p.t_comm)}
