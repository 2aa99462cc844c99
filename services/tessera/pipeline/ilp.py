"""LLM-PQ's inner ILP (docs/design/pipeline.md#ilp) for one device order and prefill micro-batch
size, with PuLP + CBC, and the two baseline ILPs (PipeEdge: bottleneck decode stage at one
bit-width; adabits: least quality loss). `Tables` holds every cost the ILP sees; `evaluate`
computes a given assignment's stage times and objective in plain Python (plans, baselines,
heuristic).

Binary z[i,j,b] = layer i on device j at bit b, x[i,j], y[i,b] its marginals:
  each layer one device and one bit; memory Σ z·M[b] <= budget_j per device; layer 0 on device
  0 and layer L-1 on device N-1; contiguity; T_pre_j >= Σ z·l_pre[j,b] (+ the pre/post-processing
  on its stage) and >= comm_pre_j, the same for decode; T_pre, T_dec >= every stage's (bottlenecks);
  objective  Σ_j T_pre_j + (⌈B/ξ⌉-1) T_pre + Σ_j T_dec_j + (⌈B/ξ_dec⌉-1) T_dec (μ_n-1) + θ Σ ω·y.
Choices where the paper leaves room, checked by tests/test_pq_planner.py's brute force:
- the variables are rewritten (see _base): a staircase u for contiguity and per-device bit
  counts c; the feasible assignments and the objective are the paper's;
- every device holds at least one layer: N devices are N stages, as ⌈B/N⌉ assumes (to plan
  without a device, leave it out of the inventory);
- omega_cap (optional) bounds Σω: plans compared with a baseline at no worse quality;
- objective='rounds' replaces the paper's decode term by the time of μ_n-1 decode rounds (the
  paper's term ignores decode on a single device): (μ_n-1) max(Σ_j T_dec_j, ⌈B/ξ_dec⌉ T_dec) where
  micro-batches flow from one step into the next (LLM-PQ's runtime), (μ_n-1) (Σ_j T_dec_j +
  (⌈B/ξ_dec⌉-1) T_dec) where every step fills and drains the pipeline (Tessera's runner).
"""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import Sequence

import pulp


class Infeasible(ValueError):
    """No assignment satisfies the memory budgets (and the stage rules)."""


@dataclass(frozen=True)
class Tables:
    """Costs for one (device order, ξ): [j] by device position, [k] by bit index, [i] by layer."""
    bits: tuple[int, ...]
    layer_bytes: tuple[float, ...]          # [k] one layer: weights + full-length KV
    budgets: tuple[float, ...]              # [j] bytes left for layers (temporaries, extras taken)
    l_pre: tuple[tuple[float, ...], ...]    # [j][k] one layer, one prefill micro-batch of ξ
    l_dec: tuple[tuple[float, ...], ...]    # [j][k] one layer, one decode micro-batch
    comm_pre: tuple[float, ...]             # [j] send to stage (j + 1) mod N
    comm_dec: tuple[float, ...]
    omega: tuple[tuple[float, ...], ...]    # [i][k] quality penalty of layer i at bits[k]
    theta: float
    prefill_micro_batches: int              # ⌈B/ξ⌉
    decode_micro_batches: int               # ⌈B/ξ_dec⌉
    mu_n: int
    pre0: float = 0.0                       # pre/post-processing (embedding, head) per micro-batch
    dec0: float = 0.0
    omega_cap: float = math.inf             # optional hard bound on Σω (a quality target)
    prepost_stage: int = 0                  # where pre0/dec0 run: stage 0 in LLM-PQ, the last in Tessera
    steps_overlap: bool = True              # decode micro-batches flow across steps (else: fill/drain)

    def __post_init__(self) -> None:
        n, k = len(self.budgets), len(self.bits)
        if not (len(self.l_pre) == len(self.l_dec) == len(self.comm_pre) == len(self.comm_dec) == n):
            raise ValueError("per-device tables disagree in length")
        if len(self.layer_bytes) != k or any(len(r) != k for r in (*self.l_pre, *self.l_dec, *self.omega)):
            raise ValueError("per-bit tables disagree in length")
        if n > len(self.omega):
            raise Infeasible(f"{n} devices but only {len(self.omega)} layers: every device must hold one")
        if not 0 <= self.prepost_stage < n:
            raise ValueError(f"pre/post-processing on stage {self.prepost_stage} of {n}")

    @property
    def layers(self) -> int:
        return len(self.omega)

    @property
    def devices(self) -> int:
        return len(self.budgets)


@dataclass(frozen=True)
class Assignment:
    device: tuple[int, ...]      # layer -> position of its device in the order
    bits: tuple[int, ...]        # layer -> bit-width


@dataclass(frozen=True)
class Evaluation:
    pre: tuple[float, ...]       # per stage: max(compute, send)
    dec: tuple[float, ...]
    objective: float             # the paper's objective (or 'rounds'), θ·Σω included
    prefill_s: float             # predicted: Σ pre + (⌈B/ξ⌉-1) max pre
    decode_s: float              # predicted: (μ_n-1) rounds (round_time: overlapping or fill/drain)
    omega: float                 # Σω (as in the tables)
    memory: tuple[float, ...]    # per stage: bytes of its layers


@dataclass(frozen=True)
class Solution:
    assignment: Assignment
    status: str                  # 'optimal' or 'feasible (time limit)'
    solve_s: float


def evaluate(t: Tables, a: Assignment, objective: str = "paper") -> Evaluation:
    ks = [t.bits.index(b) for b in a.bits]
    pre, dec, mem = [0.0] * t.devices, [0.0] * t.devices, [0.0] * t.devices
    for j, k in zip(a.device, ks):
        pre[j] += t.l_pre[j][k]
        dec[j] += t.l_dec[j][k]
        mem[j] += t.layer_bytes[k]
    pre[t.prepost_stage] += t.pre0
    dec[t.prepost_stage] += t.dec0
    pre = [max(p, c) for p, c in zip(pre, t.comm_pre)]
    dec = [max(d, c) for d, c in zip(dec, t.comm_dec)]
    omega = sum(t.omega[i][k] for i, k in enumerate(ks))
    prefill = sum(pre) + (t.prefill_micro_batches - 1) * max(pre)
    rounds = (t.mu_n - 1) * round_time(t, sum(dec), max(dec))
    if objective == "paper":
        decode_term = sum(dec) + (t.decode_micro_batches - 1) * max(dec) * (t.mu_n - 1)
    else:
        decode_term = rounds
    return Evaluation(tuple(pre), tuple(dec), prefill + decode_term + t.theta * omega, prefill, rounds, omega,
                      tuple(mem))


def round_time(t: Tables, total: float, top: float) -> float:
    """One decode round of every micro-batch, from Σ_j T_dec_j and the bottleneck T_dec."""
    if t.steps_overlap:
        return max(total, t.decode_micro_batches * top)
    return total + (t.decode_micro_batches - 1) * top


def _var(prob, name: str, low=None, up=None, cat=pulp.LpContinuous):
    """A variable of prob: PuLP >= 3.3 wants prob.add_variable, older versions LpVariable."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, low, up, cat=cat)
    return pulp.LpVariable(name, low, up, cat=cat)


def _cbc(**options):
    """CBC as the PuLP wheel bundles it. PuLP 3.3 deprecates this class for a CBC installed
    separately (COIN_CMD), which is not installed here: say nothing about it every solve."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(**options)


def _base(t: Tables, allowed: Sequence[int], name: str):
    """The assignment, memory and stage rules shared by every ILP here: (problem, z, x, y, c, u, K).

    The integer variables are u[i,j] = 1 when layer i lies on a device <= j (a staircase:
    x[i,j] = u[i,j] - u[i,j-1]) and c[j,k], the layers of device j at bits[k]. Contiguity is
    u[i,j] <= u[i-1,j]: the paper's x[i,j] + x[i-1,k] <= 1 (k > j) in other variables, with
    the same integer solutions; CBC branching on a stage boundary proves optimality far sooner
    than on x. For integral u and c, z and y are the vertices of a transportation polytope
    (each stage's layers matched to its bit counts), so they need no branching either."""
    L, N = t.layers, t.devices
    K = [k for k, b in enumerate(t.bits) if b in allowed]
    prob = pulp.LpProblem(name, pulp.LpMinimize)
    z = {(i, j, k): _var(prob, f"z_{i}_{j}_{k}", 0, 1) for i in range(L) for j in range(N) for k in K}
    u = {(i, j): _var(prob, f"u_{i}_{j}", cat=pulp.LpBinary) for i in range(L) for j in range(N - 1)}
    y = {(i, k): _var(prob, f"y_{i}_{k}", 0, 1) for i in range(L) for k in K}
    c = {(j, k): _var(prob, f"c_{j}_{k}", 0, L, cat=pulp.LpInteger) for j in range(N) for k in K}

    def below(i: int, j: int):
        return 0 if j < 0 else 1 if j == N - 1 else u[i, j]
    x = {(i, j): below(i, j) - below(i, j - 1) for i in range(L) for j in range(N)}
    for i in range(L):
        for j in range(N - 1):
            prob += below(i, j - 1) <= u[i, j]
            if i > 0:
                prob += u[i, j] <= u[i - 1, j]
        for k in K:
            prob += pulp.lpSum(z[i, j, k] for j in range(N)) == y[i, k]
        for j in range(N):
            prob += pulp.lpSum(z[i, j, k] for k in K) == x[i, j]
    unit = max(t.layer_bytes)
    for j in range(N):
        for k in K:
            prob += pulp.lpSum(z[i, j, k] for i in range(L)) == c[j, k]
        # in units of the largest layer: coefficients of 1e9 bytes make CBC's LPs ill-conditioned
        prob += pulp.lpSum(c[j, k] * (t.layer_bytes[k] / unit) for k in K) <= t.budgets[j] / unit
        prob += pulp.lpSum(x[i, j] for i in range(L)) >= 1
    for j in range(N - 1):
        prob += u[0, j] == 1           # layer 0 on device 0
        prob += u[L - 1, j] == 0       # layer L-1 on device N-1
    return prob, z, x, y, c, u, K


def _stage_times(prob, t: Tables, c, K, lat, comm, prepost: float, tag: str):
    """T_j >= compute and >= send per stage, T >= every T_j: ([T_j], T)."""
    T = [_var(prob, f"T_{tag}_{j}", 0) for j in range(t.devices)]
    top = _var(prob, f"T_{tag}", 0)
    for j in range(t.devices):
        prob += pulp.lpSum(c[j, k] * lat[j][k] for k in K) + (prepost if j == t.prepost_stage else 0) <= T[j]
        prob += T[j] >= comm[j]
        prob += top >= T[j]
    return T, top


def _scale(t: Tables) -> float:
    """A factor bringing the objective to about 1e4: CBC ignores improvements below ~1e-5 in
    absolute terms, which would be most of the differences between plans in seconds."""
    worst = t.layers * (t.prefill_micro_batches * max(map(max, t.l_pre)) + t.decode_micro_batches * t.mu_n
                        * max(map(max, t.l_dec))) + t.pre0 + t.dec0 + max(t.comm_pre) + max(t.comm_dec)
    return 1e4 / max(worst + t.theta, 1e-12)


def _warm(t: Tables, a: Assignment, z, u, y, c, K) -> None:
    """Start CBC from a known assignment: its assignment variables (solve sets the times), so
    CBC has a complete solution to start from."""
    for (i, j), v in u.items():
        v.setInitialValue(int(a.device[i] <= j))
    for i in range(t.layers):
        for j in range(t.devices):
            for k in K:
                z[i, j, k].setInitialValue(int(a.device[i] == j and a.bits[i] == t.bits[k]))
        for k in K:
            y[i, k].setInitialValue(int(a.bits[i] == t.bits[k]))
    for (j, k), v in c.items():
        v.setInitialValue(sum(1 for d, b in zip(a.device, a.bits) if d == j and b == t.bits[k]))


def _run(prob, x, y, c, t: Tables, K, time_limit_s: float, gap: float, warm: bool) -> Solution:
    solver = _cbc(msg=False, timeLimit=time_limit_s, threads=1, warmStart=warm, gapRel=gap or None)
    t0 = time.perf_counter()
    prob.solve(solver)
    took = time.perf_counter() - t0
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        why = ("no assignment fits the memory budgets" if prob.status == pulp.LpStatusInfeasible
               else f"no solution within the {time_limit_s:g} s time limit")
        raise Infeasible(f"{prob.name}: {why}")
    device = tuple(max(range(t.devices), key=lambda j: pulp.value(x[i, j])) for i in range(t.layers))
    counts = {(j, k): round(v.value()) for (j, k), v in c.items()}
    bits = _stage_bits(t, device, counts, K, {key: v.value() for key, v in y.items()})
    status = "optimal" if prob.sol_status == pulp.LpSolutionOptimal else "feasible (time limit)"
    return Solution(Assignment(device, bits), status, took)


def _stage_bits(t: Tables, device, counts, K, y) -> tuple[int, ...]:
    """Bit-widths per layer: y where the solver left it integral (a vertex), else the least-ω
    matching of each stage's layers to its bit counts (a tie can leave y between vertices)."""
    if all(min(v, 1 - v) < 1e-6 for v in y.values()):
        return tuple(t.bits[max(K, key=lambda k: y[i, k])] for i in range(t.layers))
    bits = [0] * t.layers
    for j in range(t.devices):
        layers = [i for i in range(t.layers) if device[i] == j]
        prob = pulp.LpProblem(f"bits_{j}", pulp.LpMinimize)
        w = {(i, k): _var(prob, f"w_{i}_{k}", cat=pulp.LpBinary) for i in layers for k in K}
        prob += pulp.lpSum(t.omega[i][k] * w[i, k] for i, k in w)
        for i in layers:
            prob += pulp.lpSum(w[i, k] for k in K) == 1
        for k in K:
            prob += pulp.lpSum(w[i, k] for i in layers) == counts[j, k]
        prob.solve(_cbc(msg=False, threads=1))
        for i, k in w:
            if w[i, k].value() > 0.5:
                bits[i] = t.bits[k]
    return tuple(bits)


def solve(t: Tables, objective: str = "paper", time_limit_s: float = 60.0, gap: float = 0.0,
          warm: Assignment | None = None) -> Solution:
    """LLM-PQ: the assignment minimizing the objective (docs/design/pipeline.md#objective).
    gap: relative optimality gap at which CBC may stop; warm: a feasible assignment to start from."""
    if objective not in ("paper", "rounds"):
        raise ValueError(f"objective must be 'paper' or 'rounds', not {objective!r}")
    prob, z, x, y, c, u, K = _base(t, t.bits, "llm_pq")
    T_pre, pre = _stage_times(prob, t, c, K, t.l_pre, t.comm_pre, t.pre0, "pre")
    T_dec, dec = _stage_times(prob, t, c, K, t.l_dec, t.comm_dec, t.dec0, "dec")
    omega = pulp.lpSum(t.omega[i][k] * y[i, k] for i in range(t.layers) for k in K)
    if math.isfinite(t.omega_cap):
        prob += omega <= t.omega_cap
    quality = t.theta * omega
    prefill = pulp.lpSum(T_pre) + (t.prefill_micro_batches - 1) * pre
    rnd = None
    if objective == "paper":
        decode = pulp.lpSum(T_dec) + (t.decode_micro_batches - 1) * (t.mu_n - 1) * dec
    else:
        rnd = _var(prob, "T_round", 0)
        if t.steps_overlap:
            prob += rnd >= pulp.lpSum(T_dec)
            prob += rnd >= t.decode_micro_batches * dec
        else:
            prob += rnd >= pulp.lpSum(T_dec) + (t.decode_micro_batches - 1) * dec
        decode = (t.mu_n - 1) * rnd
    prob += _scale(t) * (prefill + decode + quality)
    if warm is not None:
        ev = evaluate(t, warm, objective)
        _warm(t, warm, z, u, y, c, K)
        for T, top, times in ((T_pre, pre, ev.pre), (T_dec, dec, ev.dec)):
            for v, value in zip(T, times):
                v.setInitialValue(value)
            top.setInitialValue(max(times))
        if rnd is not None:
            rnd.setInitialValue(round_time(t, sum(ev.dec), max(ev.dec)))
    return _run(prob, x, y, c, t, K, time_limit_s, gap, warm is not None)


def solve_bottleneck(t: Tables, bits: int, time_limit_s: float = 60.0) -> Solution:
    """PipeEdge: every layer at `bits`, the partition minimizing the slowest stage's decode
    time (not phase-aware)."""
    prob, z, x, y, c, u, K = _base(t, (bits,), "pipeedge")
    _, dec = _stage_times(prob, t, c, K, t.l_dec, t.comm_dec, t.dec0, "dec")
    prob += _scale(t) * dec
    return _run(prob, x, y, c, t, K, time_limit_s, 0.0, False)


def solve_quality(t: Tables, time_limit_s: float = 60.0) -> Solution:
    """adabits: the least Σω under memory and contiguity, latency ignored."""
    prob, z, x, y, c, u, K = _base(t, t.bits, "adabits")
    ref = sum(max(row) for row in t.omega) or 1.0
    prob += 1e4 / ref * pulp.lpSum(t.omega[i][k] * y[i, k] for i in range(t.layers) for k in K)
    return _run(prob, x, y, c, t, K, time_limit_s, 0.0, False)
