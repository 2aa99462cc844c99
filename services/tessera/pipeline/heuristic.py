"""LLM-PQ's faster heuristic (`--efficient`, docs/design/pipeline.md#heuristic): start from the
adabits assignment (least Σω that fits), then repeatedly relieve the straggler (the stage with the
largest weighted time) toward the pioneer (the smallest): shift a layer along the pipeline from one
to the other, alone or with a conversion that makes room or spends it (the paper's "one 16-bit
layer <-> two lower-bit layers" patterns), or move one layer of any stage one bit-width up or down
(every stage counts in the objective's Σ_j T_j, not only the straggler). A move is kept when memory
holds and the objective (latency + θ·Σω) improves; the best move of each round is taken.
"""
from __future__ import annotations

from typing import Iterator

from tessera.pipeline.ilp import Assignment, Evaluation, Tables, evaluate


def _stages(a: Assignment, n: int) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(n)]
    for i, j in enumerate(a.device):
        out[j].append(i)
    return out


def _shift(a: Assignment, src: int, dst: int, n: int) -> Assignment | None:
    """One layer out of stage src and into stage dst, every stage between passing one along
    (layers keep their bit-widths); None when src would be left empty."""
    stages = _stages(a, n)
    if len(stages[src]) < 2:
        return None
    device = list(a.device)
    step = 1 if dst > src else -1
    for j in range(src, dst, step):
        device[stages[j][-1] if step == 1 else stages[j][0]] = j + step
    return Assignment(tuple(device), a.bits)


def _rebit(a: Assignment, layer: int, bits: int) -> Assignment:
    b = list(a.bits)
    b[layer] = bits
    return Assignment(a.device, tuple(b))


def _moves(t: Tables, a: Assignment, ev: Evaluation) -> Iterator[Assignment]:
    n = t.devices
    weight = [t.prefill_micro_batches * p + t.decode_micro_batches * (t.mu_n - 1) * d for p, d in zip(ev.pre, ev.dec)]
    slow, fast = max(range(n), key=weight.__getitem__), min(range(n), key=weight.__getitem__)
    bits = sorted(t.bits)

    def step(a2: Assignment, stage: int, up: int) -> Iterator[Assignment]:
        for i in _stages(a2, n)[stage]:
            k = bits.index(a2.bits[i]) + up
            if 0 <= k < len(bits):
                yield _rebit(a2, i, bits[k])
    for stage in range(n):      # single-precision conversions anywhere: every stage counts in Σ_j T_j
        yield from step(a, stage, -1)
        yield from step(a, stage, +1)
    shifted = _shift(a, slow, fast, n) if slow != fast else None
    if shifted is not None:
        yield shifted
        yield from step(shifted, fast, -1)
        yield from step(shifted, slow, +1)


def improve(t: Tables, start: Assignment, objective: str = "paper", max_rounds: int = 1000) -> Assignment:
    """Best-improvement local search from `start` (which must fit, and keep Σω within the cap)."""
    cur, cur_ev = start, evaluate(t, start, objective)
    for _ in range(max_rounds):
        best: tuple[Assignment, Evaluation] | None = None
        for cand in _moves(t, cur, cur_ev):
            ev = evaluate(t, cand, objective)
            if any(m > b for m, b in zip(ev.memory, t.budgets)) or ev.omega > t.omega_cap:
                continue
            if ev.objective < (best[1] if best else cur_ev).objective * (1 - 1e-12):
                best = (cand, ev)
        if best is None:
            break
        cur, cur_ev = best
    return cur
