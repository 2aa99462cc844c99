"""Discrete-event simulator of the ping-pong schedule (docs/design/disaggregation.md#simulator).

Each attention node is one server that runs, for layer l and micro-batch i, the attention
half (T_a of b/m tokens) as soon as micro-batch i's layer l-1 reply is back, in the order our
AttentionRunner uses; a dispatch reaches the expert nodes T_c later; each expert node is one
server taking micro-batches first-come first-served (T_e); the reply is back T_c later. The
step ends with T_o (embedding, final norm, LM head, sampling). Fed by a profile, it predicts
the iteration time of any (M, N, m, B): between the batch sizes the profile measured it
interpolates those measurements, outside them it uses the linear fits T(b) = k*b + c of the
paper's model (which the planner uses throughout). Interpolating matters for an MoE expert at
small micro-batches: its time is far from linear there (a handful of tokens per expert costs
about the expert's weight read).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class Linear:
    """T(b) = slope * b + intercept, in seconds (a profile's fit)."""
    slope: float
    intercept: float

    def __call__(self, b: float) -> float:
        return self.slope * b + self.intercept


@dataclass(frozen=True)
class Measured:
    """T(b) through a profile's measured (b, seconds) points, piecewise linear; the linear fit
    outside them. slope/intercept are the fit's (BALANCE and Algorithm 1 use them)."""
    points: tuple[tuple[float, float], ...]   # sorted by b
    fit: Linear

    @property
    def slope(self) -> float:
        return self.fit.slope

    @property
    def intercept(self) -> float:
        return self.fit.intercept

    def __call__(self, b: float) -> float:
        xs = [x for x, _ in self.points]
        if not xs or b < xs[0] or b > xs[-1]:
            return self.fit(b)
        i = bisect.bisect_left(xs, b)
        (x1, y1) = self.points[i]
        if x1 == b or i == 0:
            return y1
        x0, y0 = self.points[i - 1]
        return y0 + (y1 - y0) * (b - x0) / (x1 - x0)


@dataclass(frozen=True)
class StepModel:
    t_a: Linear | Measured  # one attention half + dispatch, b tokens, one layer
    t_e: Linear | Measured  # one expert node, b attention tokens of one micro-batch, one layer
    t_c: Linear | Measured  # one direction of one micro-batch, by tokens
    t_o: Linear | Measured  # per step, outside the layers
    layers: int


def micro_batch_sizes(batch: int, m: int) -> list[int]:
    """The sizes the attention node splits a step of `batch` requests into (floor(B/m), and
    floor(B/m) + 1 for the first B mod m): the sizes a profile has to measure."""
    return [batch // m + (i < batch % m) for i in range(m)]


def simulate(model: StepModel, batch: int, m: int, attention_nodes: int = 1, expert_nodes: int = 1,
             aggregate: bool = False) -> float:
    """Iteration time (s) of one decode step with `batch` tokens per attention node.

    aggregate=False is Tessera's expert node: it computes each attention node's micro-batch
    on its own, first come first served. aggregate=True is MegaScale-Infer's: micro-batch i
    of a layer is one expert computation over the tokens of every attention node, started
    once the last of them has arrived."""
    sizes = micro_batch_sizes(batch, m)
    attn_free = [0.0] * attention_nodes
    expert_free = [0.0] * expert_nodes
    ready = {(a, i): 0.0 for a in range(attention_nodes) for i in range(m)}   # reply back at
    for _ in range(model.layers):
        arrivals = []
        for a in range(attention_nodes):
            for i, b in enumerate(sizes):
                start = max(attn_free[a], ready[a, i])
                attn_free[a] = start + model.t_a(b)
                arrivals.append((attn_free[a] + model.t_c(b), a, i))
        ready = {}
        for at, group in _expert_work(arrivals, aggregate):
            tokens = sum(sizes[i] for _, i in group)
            done = 0.0
            for e in range(expert_nodes):
                expert_free[e] = max(expert_free[e], at) + model.t_e(tokens)
                done = max(done, expert_free[e])
            ready.update({(a, i): done + model.t_c(sizes[i]) for a, i in group})
    return max(max(attn_free[a], *(ready[a, i] for i in range(m))) + model.t_o(batch)
               for a in range(attention_nodes))


def _expert_work(arrivals: list[tuple[float, int, int]], aggregate: bool):
    """(start no earlier than, [(attention node, micro-batch)]) in the order an expert node
    serves them: each dispatch alone by arrival, or (aggregate) each micro-batch index once
    all attention nodes' dispatches of it are in."""
    if not aggregate:
        return [(at, [(a, i)]) for at, a, i in sorted(arrivals)]
    groups: dict[int, list] = {}
    for at, a, i in arrivals:
        groups.setdefault(i, []).append((at, a))
    work = [(max(at for at, _ in g), [(a, i) for _, a in g]) for i, g in groups.items()]
    return sorted(work, key=lambda w: (w[0], w[1][0][1]))


def paper_total(t_a: float, t_e: float, t_c: float, m: int, layers: int) -> float:
    """MegaScale-Infer Eq. 5: T_total = (T_a + T_e + 2 T_c) + T_f (m L - 1), T_f = max(T_a, T_e)."""
    t_f = max(t_a, t_e)
    return (t_a + t_e + 2 * t_c) + t_f * (m * layers - 1)
