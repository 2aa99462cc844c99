"""Round-level cost model of tree speculative decoding (docs/design/speculative.md#simulator).

Fed by a profile (t_draft(w), t_target(bs), the miss cost, per-round overheads; spec/profile.py
measures one) and by the measured distribution of tokens emitted per round (accepted + 1), it
predicts the decode speed of plain decoding, serial speculation (draft, then verify, on the
same cores) and disaggregated speculation (the draft expands while the target verifies).
Throughput is a renewal-reward ratio: tokens/s = E[tokens per round] / E[seconds per round].
It also picks d by the paper's rule, and projects the paper's own GPU ablation (SIMULATED).
Plain Python: no torch, no timing.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

MODES = ("plain", "serial", "disaggregated")


@dataclass(frozen=True)
class SpecProfile:
    """Seconds per operation, measured on the cores and threads a mode runs with.

    t_draft[w]: one draft expansion of w leaves (one draft forward of w tokens).
    t_target[bs]: one target verification of a bs-node tree, a whole engine step (t_target[1]
        is a plain decode step).
    t_prefix_flush: after a miss, the draft forwards the verified tokens its tree lacked.
    t_round: per-round draft bookkeeping outside the forwards (re-root, KV gather, subtree).
    t_comm: one round's messages between target and draft (disaggregated only).
    """
    t_draft: Mapping[int, float]
    t_target: Mapping[int, float]
    t_prefix_flush: float = 0.0
    t_round: float = 0.0
    t_comm: float = 0.0

    def draft(self, w: int) -> float:
        return interpolate(self.t_draft, w)

    def target(self, bs: int) -> float:
        return interpolate(self.t_target, bs)


@dataclass(frozen=True)
class Shape:
    """A round's tree: bs nodes verified (root included), w leaves per expansion, d expansions."""
    bs: int = 8
    w: int = 4
    d: int = 3


@dataclass(frozen=True)
class Rounds:
    """Measured outcome of speculation rounds: how often each number of tokens was emitted in
    one round (accepted + 1 >= 1), and the fraction of rounds whose new root was in the draft
    tree (a hit keeps the tree cache; a miss restarts the tree), and when measured, how many
    expansions per round the draft had to make after the verified tokens arrived (its tree
    was short of bs: the round waits for them); None: derived from the hit rate."""
    emitted: Mapping[float, float] = field(default_factory=lambda: {1: 1})   # tokens -> rounds
    hit_rate: float = 0.0
    topups: float | None = None
    nodes: Mapping[int, float] | None = None   # tree size verified -> rounds (1: a plain step)

    @classmethod
    def of(cls, per_round: Sequence[int], hit_rate: float = 0.0, topups: float | None = None,
           nodes: Sequence[int] = ()) -> "Rounds":
        """From the tokens each measured round emitted (and the tree each verified, if known)."""
        return cls(dict(Counter(per_round)) or {1: 1}, hit_rate, topups, dict(Counter(nodes)) or None)

    def verify_s(self, p: "SpecProfile", bs: int) -> float:
        """E[t_target] per round: at the measured tree sizes when known (a drafter may send a
        smaller tree, or none: prompt lookup with nothing to look up), else a bs-node tree."""
        if not self.nodes:
            return p.target(bs)
        return sum(p.target(n) * k for n, k in self.nodes.items()) / sum(self.nodes.values())

    @classmethod
    def with_mean(cls, mean: float, hit_rate: float = 0.0) -> "Rounds":
        """Only the average is known (a paper's acceptance length): one point mass."""
        return cls({mean: 1}, hit_rate)

    @property
    def mean(self) -> float:
        """E[accepted + 1]: the acceptance length (tokens per target verification)."""
        total = sum(self.emitted.values())
        return sum(k * n for k, n in self.emitted.items()) / total


def interpolate(times: Mapping[int, float], n: int) -> float:
    """times at n: measured value, piecewise linear between measured sizes, and the nearest
    segment's line outside them (a constant when only one size was measured)."""
    if n in times:
        return times[n]
    xs = sorted(times)
    if len(xs) == 1:
        return times[xs[0]]
    i = min(max(sum(x < n for x in xs), 1), len(xs) - 1)
    x0, x1 = xs[i - 1], xs[i]
    return max(times[x0] + (times[x1] - times[x0]) * (n - x0) / (x1 - x0), 0.0)


def fill_expansions(bs: int, w: int) -> int:
    """Expansions that grow a fresh tree (the root alone) to bs nodes: the first expands the
    root (+w nodes), each later one w leaves (+w^2): nodes(k) = 1 + w + (k - 1) w^2 >= bs."""
    if bs <= 1:
        return 0
    if w <= 1:
        return bs - 1
    return 1 + max(0, math.ceil((bs - 1 - w) / (w * w)))


def grow_s(p: SpecProfile, bs: int, w: int) -> float:
    """A fresh tree to bs nodes: t_draft(1) (root) + (fill - 1) * t_draft(w); t_draft(1)
    falls back to the profile's nearest size when 1 was not measured."""
    k = fill_expansions(bs, w)
    return p.draft(1) + (k - 1) * p.draft(w) if k else 0.0


def serial_round_s(p: SpecProfile, s: Shape, hit_rate: float, topups: float | None = None,
                   verify_s: float | None = None) -> float:
    """Serial round: t_round + (1 - hit) t_prefix_flush + max(d, fill) t_draft(w) + t_target(bs).
    Draft and verification take turns on the same cores; a miss costs the flush (the d
    expansions regrow the tree, with extra ones only if d < fill). With measured top-ups the
    draft makes d + topups expansions instead of max(d, fill); with measured tree sizes the
    verification costs verify_s (Rounds.verify_s) instead of t_target(bs)."""
    expansions = max(s.d, fill_expansions(s.bs, s.w)) if topups is None else s.d + topups
    return (p.t_round + (1 - hit_rate) * p.t_prefix_flush + expansions * p.draft(s.w)
            + (p.target(s.bs) if verify_s is None else verify_s))


def disaggregated_round_s(p: SpecProfile, s: Shape, hit_rate: float, topups: float | None = None,
                          verify_s: float | None = None) -> float:
    """Disaggregated round: max(t_target(bs) + t_comm, d t_draft(w)) + t_round
    + (1 - hit) (t_prefix_flush + grow(bs, w)), or with measured top-ups
    + (1 - hit) t_prefix_flush + topups t_draft(w).
    The draft's d expansions overlap the verification and its messages; re-rooting, and the
    expansions a short tree needs (after a miss; after a hit too when the surviving subtree is
    smaller than bs), sit between receiving the verified tokens and sending the next tree, so
    the target waits for them."""
    overlap = max((p.target(s.bs) if verify_s is None else verify_s) + p.t_comm, s.d * p.draft(s.w))
    regrow = grow_s(p, s.bs, s.w) * (1 - hit_rate) if topups is None else topups * p.draft(s.w)
    return overlap + p.t_round + (1 - hit_rate) * p.t_prefix_flush + regrow


def plain_tok_s(p: SpecProfile) -> float:
    """Plain decoding: one token per step, 1 / t_target(1)."""
    return 1.0 / p.target(1)


def tok_s(mode: str, p: SpecProfile, s: Shape, rounds: Rounds) -> float:
    """Predicted decode speed of `mode`: E[accepted + 1] / E[round seconds] (plain: 1 / t_target(1))."""
    if mode == "plain":
        return plain_tok_s(p)
    if mode == "serial":
        return rounds.mean / serial_round_s(p, s, rounds.hit_rate, rounds.topups, rounds.verify_s(p, s.bs))
    if mode == "disaggregated":
        return rounds.mean / disaggregated_round_s(p, s, rounds.hit_rate, rounds.topups, rounds.verify_s(p, s.bs))
    raise ValueError(f"mode must be one of {MODES}, not {mode!r}")


def depth_candidates(p: SpecProfile, bs: int, w: int) -> tuple[int, int]:
    """SwiftSpec's rule (docs/design/speculative.md#tree-growth): r = floor((t_target(bs) + t_comm)
    / t_draft(w)) expansions fit in the time the target verifies; try r and r + 1 (r at least
    1)."""
    r = max(1, math.floor((p.target(bs) + p.t_comm) / p.draft(w)))
    return r, r + 1


RoundsAt = Callable[[int], Rounds]   # d -> the rounds speculation with depth d would see


def choose_depth(p: SpecProfile, bs: int, w: int, rounds_at: RoundsAt, mode: str = "disaggregated") -> int:
    """The faster of the paper's two candidates under the simulator (ties: the smaller d)."""
    return max(depth_candidates(p, bs, w), key=lambda d: (tok_s(mode, p, Shape(bs, w, d), rounds_at(d)), -d))


def best_depth(p: SpecProfile, bs: int, w: int, rounds_at: RoundsAt, depths: Sequence[int],
               mode: str = "disaggregated") -> int:
    """Brute force: the d in `depths` the simulator finds fastest (ties: the smaller d)."""
    return max(depths, key=lambda d: (tok_s(mode, p, Shape(bs, w, d), rounds_at(d)), -d))


def latency_bound_size(times: Mapping[int, float], tolerance: float = 0.1) -> int:
    """The largest measured size whose time is within `tolerance` of the smallest size's: the
    paper picks bs and w where a bigger batch stops being (almost) free
    (docs/design/speculative.md#tree-growth)."""
    base = times[min(times)]
    return max(n for n, t in times.items() if t <= (1 + tolerance) * base)


# The paper's ablation (SwiftSpec §4.3, Table 7; docs/design/speculative.md#paper-ablation):
# Qwen2-72B target, Qwen2-1.5B draft, int4 AWQ, 8 x H800, bs = w = 8 (§3.1.3). Serial: both models
# on all 8 GPUs, in turn; parallel: target on 6 GPUs, draft on 2. Times in seconds; the serial
# draft is 3.73 ms in the table (3.72 in the text).
PAPER_DATASETS = ("Alpaca", "GSM8K", "HumanEval", "MT-Bench", "QA", "Summarization")
PAPER_ACCEPTANCE = {"serial": (3.28, 4.2, 4.04, 3.42, 3.12, 3.72),
                    "disaggregated": (2.92, 3.78, 3.92, 3.11, 2.74, 3.56)}
PAPER_PROFILE = {"serial": SpecProfile(t_draft={8: 3.73e-3}, t_target={8: 10.34e-3}),
                 "disaggregated": SpecProfile(t_draft={8: 3.25e-3}, t_target={8: 10.48e-3})}
PAPER_TOK_S = {"serial": 200.0, "disaggregated": 274.0}
# Ours, not the paper's: it does not say how often the verified root falls out of the draft
# tree, nor the per-round message and bookkeeping times (taken as 0 on NVLink).
PAPER_MISS_RATE = 0.5


def paper_mode(mode: str, miss_rate: float) -> dict:
    """One mode of the paper's ablation, SIMULATED: d by the paper's rule (the same rule is
    assumed for the serial baseline, whose d the paper does not give); tokens/s averaged
    over the six datasets' acceptance lengths."""
    p = PAPER_PROFILE[mode]
    hit = 1 - miss_rate if mode == "disaggregated" else 1.0   # serial: a miss costs nothing extra
    lengths = PAPER_ACCEPTANCE[mode]
    d = choose_depth(p, 8, 8, lambda _: Rounds.with_mean(sum(lengths) / len(lengths), hit), mode)
    shape = Shape(8, 8, d)
    per_dataset = {name: tok_s(mode, p, shape, Rounds.with_mean(a, hit)) for name, a in zip(PAPER_DATASETS, lengths)}
    predicted = sum(per_dataset.values()) / len(per_dataset)
    return {"d": d, "acceptance_length": round(sum(lengths) / len(lengths), 3),
            "predicted_tok_s": round(predicted, 1), "paper_tok_s": PAPER_TOK_S[mode],
            "error": round(predicted / PAPER_TOK_S[mode] - 1, 3),
            "per_dataset_tok_s": {k: round(v, 1) for k, v in per_dataset.items()}}


def paper_projection(miss_rate: float = PAPER_MISS_RATE) -> dict:
    """The paper's serial vs disaggregated ablation from its own inputs: SIMULATED, not measured.
    Also the disaggregated speed at never / always missing (the bracket any miss rate falls in)
    and the miss rate that would reproduce the paper's 274 tok/s exactly (a fit, not a prediction)."""
    serial, disagg = paper_mode("serial", miss_rate), paper_mode("disaggregated", miss_rate)
    hits, misses = (paper_mode("disaggregated", m)["predicted_tok_s"] for m in (0.0, 1.0))
    p, shape = PAPER_PROFILE["disaggregated"], Shape(8, 8, disagg["d"])
    t_hit, t_miss = disaggregated_round_s(p, shape, 1.0), disaggregated_round_s(p, shape, 0.0)
    mean = sum(PAPER_ACCEPTANCE["disaggregated"]) / len(PAPER_DATASETS)
    implied = (mean / PAPER_TOK_S["disaggregated"] - t_hit) / (t_miss - t_hit)
    speedup = disagg["predicted_tok_s"] / serial["predicted_tok_s"]
    paper_speedup = PAPER_TOK_S["disaggregated"] / PAPER_TOK_S["serial"]
    return {"simulated": True,
            "source": "SwiftSpec §4.3 / Table 7: Qwen2-72B + Qwen2-1.5B, 8 x H800, bs = w = 8",
            "assumed": {"miss_rate": miss_rate, "t_comm_s": 0.0, "t_round_s": 0.0,
                        "serial_d": "the paper's rule, as for the parallel mode"},
            "serial": serial, "disaggregated": disagg,
            "speedup": round(speedup, 3), "paper_speedup": round(paper_speedup, 3),
            "speedup_error": round(speedup / paper_speedup - 1, 3),
            "disaggregated_tok_s_bracket": {"never_miss": hits, "always_miss": misses},
            "implied_miss_rate": round(implied, 3)}
