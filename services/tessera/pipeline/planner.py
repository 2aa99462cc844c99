"""LLM-PQ's outer loop (docs/design/pipeline.md#outer-loop) and its baselines, all in one framework.

For every candidate (device order, prefill micro-batch ξ) the cost models give `Tables`; a
method turns them into an assignment; the plan kept is the method's best candidate:
- orders: permutations of device *types* (devices of a type stay together, in file order);
- decode micro-batch ⌈B/N⌉; ξ among the divisors of ⌈B/N⌉, 1 excluded unless it is the only
  one (a regression fitted on larger batches is least trusted there:
  docs/design/pipeline.md#extrapolation);
- 'llm-pq': the ILP (ilp.solve), or with efficient=True the straggler/pioneer heuristic; kept by
  objective;
- 'pipeedge': highest uniform bit-width with a partition that fits, partition minimizing the
  bottleneck decode stage; 'uniform': even layer split, highest uniform bit-width that fits;
  'adabits': least Σω that fits, latency ignored (ties broken by predicted time). Baselines get
  the same candidates and keep the one with the best predicted time, as tuned as our own.
The indicator ω is normalized by Σ_ℓ max_b ω[ℓ, b] (the whole model at its worst bit-width) so
that θ reads as seconds: the predicted batch time worth that whole quality loss.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Protocol

from tessera.pipeline import heuristic, ilp
from tessera.pipeline.costmodel import MemoryModel
from tessera.pipeline.devices import Cluster, Device
from tessera.pipeline.ilp import Assignment, Infeasible, Tables, evaluate
from tessera.pipeline.plan import Plan, Stage, stage_fixed_bytes


class LatencyModel(Protocol):
    """One device type's layer times (costmodel.ProfiledLatency, roofline.Roofline)."""
    @property
    def bits(self) -> tuple[int, ...]: ...
    @property
    def label(self) -> str: ...

    def prefill(self, bits: int, b: int, s: int) -> float: ...
    def decode(self, bits: int, b: int, s: int, i: int) -> float: ...
    def prepost_prefill(self, b: int, s: int) -> float: ...
    def prepost_decode(self, b: int) -> float: ...
    def outside(self, xi: int, s: int, b: int, i: int) -> list[str]: ...


@dataclass(frozen=True)
class Workload:
    batch: int                       # global batch B
    prompt_len: int                  # s
    gen_len: int                     # n
    theta: float = 1.0               # seconds of predicted time worth the whole model's worst quality loss
    gamma: float = 1.0               # μ_n = γ·n expected generated tokens
    objective: str = "paper"         # 'paper' or 'rounds' (see ilp.py)
    time_limit_s: float = 60.0       # per ILP
    gap: float = 0.0                 # relative optimality gap at which CBC may stop (0: prove optimal)
    omega_cap: float | None = None   # LLM-PQ only: Σω (the indicator as given) at most this

    def __post_init__(self) -> None:
        if min(self.batch, self.prompt_len, self.gen_len) < 1:
            raise ValueError("batch, prompt length and generated length must be >= 1")
        if self.theta < 0 or not 0 < self.gamma <= 1 or self.time_limit_s <= 0 or not 0 <= self.gap < 1:
            raise ValueError("need theta >= 0, 0 < gamma <= 1, time limit > 0, 0 <= gap < 1")
        if self.objective not in ("paper", "rounds"):
            raise ValueError(f"objective must be 'paper' or 'rounds', not {self.objective!r}")

    @property
    def mu_n(self) -> int:
        return max(1, int(self.gamma * self.gen_len))


@dataclass(frozen=True)
class CostModel:
    """What does not depend on the device order: memory, latency by device type, ω[layer][bit]."""
    name: str
    memory: MemoryModel
    latency: Mapping[str, LatencyModel]
    omega: tuple[tuple[float, ...], ...]
    bits: tuple[int, ...]
    # whose runtime the times describe: 'tessera' (pipeline/runner.py: the last stage computes the
    # head and sends float32 logits back; each decode step fills and drains the pipeline) or
    # 'llm-pq' (the paper's: embedding and head on stage 0, micro-batches flow across steps)
    runtime: str = "tessera"

    def head_stage(self, stages: int) -> int:
        """The stage holding the final norm and LM head (its time and memory): our runtime's
        last, LLM-PQ's first (with the embeddings: its pre/post-processing)."""
        return stages - 1 if self.runtime == "tessera" else 0

    def __post_init__(self) -> None:
        if self.runtime not in ("tessera", "llm-pq"):
            raise ValueError(f"runtime must be 'tessera' or 'llm-pq', not {self.runtime!r}")
        if len(self.omega) != self.memory.shape.layers or any(len(r) != len(self.bits) for r in self.omega):
            raise ValueError(f"ω must be [{self.memory.shape.layers} layers][{len(self.bits)} bit-widths]")
        for dtype, lat in self.latency.items():
            missing = sorted(set(self.bits) - set(lat.bits))
            if missing:
                raise ValueError(f"device type {dtype}: no latency model for bit-widths {missing}")


def prefill_sizes(decode_batch: int) -> list[int]:
    divisors = [d for d in range(1, decode_batch + 1) if decode_batch % d == 0]
    return [d for d in divisors if d > 1] or divisors


def type_orders(cluster: Cluster) -> list[tuple[Device, ...]]:
    groups = {t: [d for d in cluster.devices if d.type == t] for t in cluster.types()}
    return [tuple(d for t in perm for d in groups[t]) for perm in itertools.permutations(groups)]


def candidates(cluster: Cluster, batch: int) -> list[tuple[tuple[Device, ...], int]]:
    decode_batch = math.ceil(batch / len(cluster.devices))
    return [(order, xi) for order in type_orders(cluster) for xi in prefill_sizes(decode_batch)]


def tables_for(cluster: Cluster, cost: CostModel, work: Workload, order: tuple[Device, ...], xi: int) -> Tables:
    n, s, mem = len(order), work.prompt_len, cost.memory
    b_dec, i_mid, full = math.ceil(work.batch / n), work.mu_n // 2, work.prompt_len + work.gen_len
    lat = [(cost.latency[d.type], d.slowdown) for d in order]
    h, ours, head = mem.shape.hidden, cost.runtime == "tessera", cost.head_stage(n)
    pp = lat[head]

    def comm(hidden_bytes: float, logit_bytes: float) -> tuple[float, ...]:
        """Stage j's send to (j + 1) mod N: hidden states, and from our last stage float32 logits."""
        if n == 1:
            return (0.0,)
        sends = [hidden_bytes] * (n - 1) + [logit_bytes if ours else hidden_bytes]
        return tuple(cluster.link(order[j], order[(j + 1) % n]).time(sends[j]) for j in range(n))
    ref = sum(max(row) for row in cost.omega) or 1.0
    return Tables(
        bits=cost.bits,
        layer_bytes=tuple(mem.layer_bytes(b, work.batch, full) for b in cost.bits),
        budgets=tuple(d.budget_bytes() - stage_fixed_bytes(mem, j == 0, j == head, xi, s, b_dec, full)
                      for j, d in enumerate(order)),
        l_pre=tuple(tuple(m.prefill(b, xi, s) * k for b in cost.bits) for m, k in lat),
        l_dec=tuple(tuple(m.decode(b, b_dec, s, i_mid) * k for b in cost.bits) for m, k in lat),
        comm_pre=comm(2 * h * s * xi, 4 * mem.shape.vocab * xi), comm_dec=comm(2 * h * b_dec, 4 * mem.shape.vocab * b_dec),
        omega=tuple(tuple(w / ref for w in row) for row in cost.omega), theta=work.theta,
        prefill_micro_batches=math.ceil(work.batch / xi), decode_micro_batches=math.ceil(work.batch / b_dec),
        mu_n=work.mu_n, omega_cap=math.inf if work.omega_cap is None else work.omega_cap / ref * (1 + 1e-9),
        pre0=pp[0].prepost_prefill(xi, s) * pp[1], dec0=pp[0].prepost_decode(b_dec) * pp[1],
        prepost_stage=head, steps_overlap=not ours)


def even_split(layers: int, n: int) -> tuple[int, ...]:
    """Layer -> stage for an even split (the first layers % n stages hold one more)."""
    sizes = [layers // n + (j < layers % n) for j in range(n)]
    return tuple(j for j, size in enumerate(sizes) for _ in range(size))


def uniform_assignment(t: Tables) -> Assignment:
    device = even_split(t.layers, t.devices)
    for b in sorted(t.bits, reverse=True):
        a = Assignment(device, (b,) * t.layers)
        if all(m <= cap for m, cap in zip(evaluate(t, a).memory, t.budgets)):
            return a
    raise Infeasible("uniform: no single bit-width fits an even split")


def warm_start(t: Tables, objective: str) -> Assignment | None:
    """A good first incumbent for CBC: the heuristic from the uniform plan (None if that does
    not fit). CBC's own heuristics find good plans of 8 stages x 70 layers only slowly."""
    try:
        start = uniform_assignment(t)
    except Infeasible:
        return None
    return heuristic.improve(t, start, objective) if evaluate(t, start).omega <= t.omega_cap else None


def pipeedge_assignment(t: Tables, time_limit_s: float) -> Assignment:
    for b in sorted(t.bits, reverse=True):
        try:
            return ilp.solve_bottleneck(t, b, time_limit_s).assignment
        except Infeasible:
            continue
    raise Infeasible("pipeedge: no single bit-width fits any partition")


def method_fns(work: Workload) -> dict[str, tuple[Callable[[Tables], tuple[Assignment, str]], Callable]]:
    """name -> (assignment for one candidate's tables with a status, key ranking candidates)."""
    by_objective = lambda ev: ev.objective                        # noqa: E731
    by_time = lambda ev: ev.prefill_s + ev.decode_s                # noqa: E731

    def llm_pq(t: Tables):
        sol = ilp.solve(t, work.objective, work.time_limit_s, work.gap, warm_start(t, work.objective))
        return sol.assignment, sol.status

    def efficient(t: Tables):
        start = ilp.solve_quality(t, work.time_limit_s).assignment
        return heuristic.improve(t, start, work.objective), "heuristic"
    return {
        "llm-pq": (llm_pq, by_objective),
        "llm-pq (heuristic)": (efficient, by_objective),
        "pipeedge": (lambda t: (pipeedge_assignment(t, work.time_limit_s), "optimal"), by_time),
        "uniform": (lambda t: (uniform_assignment(t), "even split"), by_time),
        "adabits": (lambda t: (ilp.solve_quality(t, work.time_limit_s).assignment, "optimal"),
                    lambda ev: (round(ev.omega, 12), by_time(ev))),
    }


def plan_method(method: str, cluster: Cluster, cost: CostModel, work: Workload) -> Plan:
    """The method's best plan over every (order, ξ) candidate; Infeasible when none fits."""
    assign, key = method_fns(work)[method]
    t0, best, reasons, stopped = time.perf_counter(), None, [], 0
    for order, xi in candidates(cluster, work.batch):
        try:
            t = tables_for(cluster, cost, work, order, xi)
            a, status = assign(t)
        except Infeasible as e:
            reasons.append(str(e))
            continue
        stopped += "time limit" in status
        ev = evaluate(t, a, work.objective)
        if best is None or key(ev) < key(best[-1]):
            best = (order, xi, t, a, status, ev)
    if best is None:
        raise Infeasible(f"{method}: no device order and micro-batch size fits ({reasons[0] if reasons else ''})")
    plan = make_plan(method, cost, work, *best, planning_s=time.perf_counter() - t0)
    if stopped:      # a candidate not solved to optimality might have held a better plan
        plan = replace(plan, status=f"{plan.status}; {stopped} of {len(candidates(cluster, work.batch))} "
                                    "candidate ILPs stopped at the time limit")
    return plan


def make_plan(method: str, cost: CostModel, work: Workload, order: tuple[Device, ...], xi: int, t: Tables,
              a: Assignment, status: str, ev: ilp.Evaluation, planning_s: float) -> Plan:
    mem = cost.memory
    b_dec = math.ceil(work.batch / len(order))
    full = work.prompt_len + work.gen_len
    stages = []
    for j, d in enumerate(order):
        layers = [i for i, dj in enumerate(a.device) if dj == j]
        bits = tuple(a.bits[i] for i in layers)
        fixed = stage_fixed_bytes(mem, j == 0, j == cost.head_stage(len(order)), xi, work.prompt_len, b_dec, full)
        stages.append(Stage(d.name, d.type, layers[0], layers[-1] + 1, bits, ev.pre[j], ev.dec[j],
                            ev.memory[j] + fixed, d.budget_bytes()))
    omega = sum(cost.omega[i][cost.bits.index(b)] for i, b in enumerate(a.bits))
    label = " + ".join(sorted({cost.latency[d.type].label for d in order}))
    return Plan(method, cost.name, work.batch, work.prompt_len, work.gen_len, xi, b_dec, tuple(stages),
                ev.objective, ev.prefill_s, ev.decode_s, omega, planning_s, status, label)


def plan_all(cluster: Cluster, cost: CostModel, work: Workload, efficient: bool = False) -> dict[str, Plan | str]:
    """LLM-PQ (ILP, or the heuristic) and the three baselines: method -> plan, or why none fits."""
    methods = ["llm-pq (heuristic)" if efficient else "llm-pq", "pipeedge", "uniform", "adabits"]
    out: dict[str, Plan | str] = {}
    for m in methods:
        try:
            out[m] = plan_method(m, cluster, cost, work)
        except Infeasible as e:
            out[m] = str(e)
    return out


def predict(plan: Plan, cluster: Cluster, cost: CostModel, work: Workload) -> ilp.Evaluation:
    """The plan's layers, bits, device order and ξ, as they are, costed for another workload
    (held-out (B, s, n) points: the runtime keeps ξ, or takes all B prompts in one prefill
    micro-batch when B < ξ, and cuts B into one decode micro-batch per stage as planned).
    When ξ does not divide B the runtime's last prefill micro-batch holds the rest
    (micro_batches.split_micro_batches): it enters the pipeline last and costs its own size."""
    ev, _, full, last = _costed(plan, cluster, cost, work)
    if last is None:
        return ev
    return replace(ev, prefill_s=sum(ev.pre) + (full - 1) * max(ev.pre) + max(last))


def stage_seconds(plan: Plan, cluster: Cluster, cost: CostModel, work: Workload) -> tuple[float, ...]:
    """Per stage, the predicted time in its own layers (and the ends the model gives it: embedding
    and head on the head stage) over the whole workload: every prefill micro-batch, then every
    decode micro-batch of the n - 1 rounds. What a stage reports as its compute seconds (bench pq
    compares the two). A stage's time per micro-batch is max(compute, its send), as in the
    planner's tables; a stage's counter has no sends, so this holds while links are faster than
    layers (here: loopback TCP, a few KB per micro-batch)."""
    ev, t, full, last = _costed(plan, cluster, cost, work)
    rounds = (t.mu_n - 1) * t.decode_micro_batches
    return tuple(full * pre + (last[j] if last else 0.0) + rounds * dec
                 for j, (pre, dec) in enumerate(zip(ev.pre, ev.dec)))


def _costed(plan: Plan, cluster: Cluster, cost: CostModel, work: Workload):
    """(evaluation at ξ, its tables, full prefill micro-batches, per-stage times of the last
    partial one or None)."""
    devices = {d.name: d for d in cluster.devices}
    order = tuple(devices[s.device] for s in plan.stages)
    assignment = Assignment(tuple(j for j, s in enumerate(plan.stages) for _ in range(s.start, s.end)),
                            plan.layer_bits)
    xi = min(plan.xi, work.batch)
    t = tables_for(cluster, cost, work, order, xi)
    ev = evaluate(t, assignment, work.objective)
    full, rest = divmod(work.batch, xi)
    last = evaluate(tables_for(cluster, cost, work, order, rest), assignment, work.objective).pre if rest else None
    return ev, t, full, last
