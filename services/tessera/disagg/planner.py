"""`tessera plan afd`: MegaScale-Infer's deployment plan search, Algorithm 1
(docs/design/disaggregation.md#plan-search).

Search over (tp_a, tp_e, n_a, m, B) for the best decode throughput per unit cost under a
time-between-tokens SLO, with the paper's performance model:
- per-device linear fits T_a = k1 b_a + k2, T_e = k3 b_e + k4 (here from a roofline of each
  GPU of MegaScale-Infer's table, sampled and fitted; from `tessera profile` on this machine),
- token conservation b_a m n_a = b_e m E / K = B, BALANCE n_a = k1 E / (k3 K),
- T_c = max(b_a h K / tp_a / W_a, b_e h / tp_e / W_e) (bf16 activations, link bandwidth W),
- constraints T_c < T_f and m T_f >= 2 (T_f + T_c), the attention memory bound (Eq. 8),
  weights that fit, and T_total (Eq. 5) <= SLO,
- tpuc = (B / T_total) / (tp_a n_a Cost_a + tp_e E Cost_e).
The heterogeneous variant runs the same search for every (attention GPU, expert GPU) pair.
Every number it prints is a prediction of the model, not a measurement.
"""
from __future__ import annotations

from dataclasses import dataclass

from tessera.disagg.simulator import paper_total


@dataclass(frozen=True)
class Gpu:
    name: str
    price: float          # normalized, L20 = 1.00
    mem_gb: float
    bw_gbs: float
    tflops: float
    net_gbs: float = 50.0   # per-GPU NIC: 400 Gb/s


# MegaScale-Infer Table 3 (docs/design/disaggregation.md#gpu-table)
GPUS = {g.name: g for g in (
    Gpu("L20", 1.00, 48, 864, 119.5), Gpu("H800", 5.28, 80, 3430.4, 989), Gpu("A800", 2.26, 80, 2039, 312),
    Gpu("H20", 1.85, 96, 4096, 148), Gpu("L40S", 1.08, 48, 864, 362))}


@dataclass(frozen=True)
class MoeShape:
    name: str
    layers: int
    hidden: int
    inter: int            # h' (one expert's intermediate size)
    experts: int
    top_k: int
    gqa: int              # g: query heads per KV head
    seq_len: int          # s: mean context during decode
    vocab: int = 32000


# MegaScale-Infer Table 4 and a median 571 + 159 token trace
# (docs/design/disaggregation.md#gpu-table)
MODELS = {m.name: m for m in (
    MoeShape("mixtral-8x22b", 56, 6144, 16384, 8, 2, 6, 730),
    MoeShape("dbrx", 40, 6144, 10752, 16, 4, 8, 730),
    MoeShape("scaled-moe", 48, 8192, 8192, 32, 4, 8, 730))}


@dataclass(frozen=True)
class Plan:
    attention_gpu: str
    expert_gpu: str
    tp_a: int
    tp_e: int
    n_a: int
    m: int
    batch: int
    t_a: float
    t_e: float
    t_c: float
    t_total: float
    throughput: float     # tokens/s per instance
    tpuc: float           # tokens/s per unit cost
    checks: dict


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    k = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return k, my - k * mx


def attention_time(s: MoeShape, gpu: Gpu, tp: int, b: float) -> float:
    """One micro-batch of b tokens through one layer's attention half (bf16 roofline)."""
    h, kv_w = s.hidden, s.hidden // s.gqa
    weights = 2 * (h * (h + 2 * kv_w) + h * h) / tp
    flops = 2 * b * (h * (h + 2 * kv_w) + h * h) / tp + 4 * b * s.seq_len * h / tp
    bytes_ = weights + 2 * 2 * b * s.seq_len * kv_w / tp      # bf16 K and V of b sequences
    return max(flops / (gpu.tflops * 1e12), bytes_ / (gpu.bw_gbs * 1e9)) + 20e-6 * (tp > 1)


def expert_time(s: MoeShape, gpu: Gpu, tp: int, b: float) -> float:
    """One expert's FFN (gate, up, down) on b tokens, one layer (bf16 roofline)."""
    flops = 2 * b * 3 * s.hidden * s.inter / tp
    bytes_ = 2 * 3 * s.hidden * s.inter / tp + 4 * b * s.hidden
    return max(flops / (gpu.tflops * 1e12), bytes_ / (gpu.bw_gbs * 1e9))


def attention_fit(s: MoeShape, gpu: Gpu, tp: int) -> tuple[float, float]:
    """(k1, k2): the paper's linear T_a, fitted to the roofline where decode batches lie."""
    return _fit([(b, attention_time(s, gpu, tp, b)) for b in (32, 64, 128, 256, 512)])


def expert_fit(s: MoeShape, gpu: Gpu, tp: int) -> tuple[float, float]:
    """(k3, k4): the paper's linear T_e for b_e tokens of one micro-batch."""
    return _fit([(b, expert_time(s, gpu, tp, b)) for b in (64, 128, 256, 512, 1024)])


def a2e_bytes(s: MoeShape, b_a: float, tp_a: int) -> float:
    """Bytes one attention GPU dispatches per micro-batch: each of b_a tokens' bf16 hidden
    state to its K experts, the hidden dimension split over tp_a GPUs."""
    return 2 * b_a * s.hidden * s.top_k / tp_a


def evaluate(s: MoeShape, ga: Gpu, ge: Gpu, tp_a: int, tp_e: int, m: int, batch: int, slo_s: float):
    """The plan for one point of the search, or None where a constraint fails."""
    k1, k2 = attention_fit(s, ga, tp_a)
    k3, k4 = expert_fit(s, ge, tp_e)
    n_a = max(1, round(k1 * s.experts / (k3 * s.top_k)))          # BALANCE
    b_a = batch / (m * n_a)
    b_e = batch * s.top_k / (m * s.experts)
    t_a, t_e = k1 * b_a + k2, k3 * b_e + k4
    t_f = max(t_a, t_e)
    t_c = max(a2e_bytes(s, b_a, tp_a) / (ga.net_gbs * 1e9),
              2 * b_e * s.hidden / tp_e / (ge.net_gbs * 1e9))
    t_total = paper_total(t_a, t_e, t_c, m, s.layers)
    params_a = 2 * s.layers * (s.hidden * (s.hidden + 2 * s.hidden // s.gqa) + s.hidden ** 2) + 4 * s.vocab * s.hidden
    params_e = 2 * s.layers * 3 * s.hidden * s.inter
    kv = 4 * m * b_a * s.seq_len * s.hidden * s.layers / s.gqa        # Eq. 8, bf16 K and V
    checks = {"T_c < T_f": t_c < t_f, "m T_f >= 2 (T_f + T_c)": m * t_f >= 2 * (t_f + t_c),
              "attention memory (Eq. 8)": kv + params_a < tp_a * ga.mem_gb * 1e9,
              "expert weights fit": params_e < tp_e * ge.mem_gb * 1e9, "SLO": t_total <= slo_s}
    if not all(checks.values()):
        return None
    cost = tp_a * n_a * ga.price + tp_e * s.experts * ge.price
    return Plan(ga.name, ge.name, tp_a, tp_e, n_a, m, batch, t_a, t_e, t_c, t_total, batch / t_total,
                batch / t_total / cost, checks)


def search(s: MoeShape, attention_gpus: list[str], expert_gpus: list[str], slo_s: float = 0.150,
           tps=(1, 2, 4, 8), max_m: int = 4, min_m: int = 3, max_batch: int = 1 << 16) -> Plan | None:
    """Algorithm 1: for each (tp_e, tp_a) and m, the largest B meeting the SLO (binary search),
    keeping the plan with the best throughput per cost; heterogeneous over GPU pairs."""
    best = None
    for ga in attention_gpus:
        for ge in expert_gpus:
            for tp_e in tps:
                for tp_a in tps:
                    for m in range(min_m, max_m + 1):
                        plan = _largest_batch(s, GPUS[ga], GPUS[ge], tp_a, tp_e, m, slo_s, max_batch)
                        if plan and (best is None or plan.tpuc > best.tpuc):
                            best = plan
    return best


def _largest_batch(s, ga, ge, tp_a, tp_e, m, slo_s, max_batch) -> Plan | None:
    lo, hi, found = m, max_batch, None
    while lo <= hi:
        mid = (lo + hi) // 2
        plan = evaluate(s, ga, ge, tp_a, tp_e, m, mid, slo_s)
        if plan:
            found, lo = plan, mid + 1
        else:
            hi = mid - 1
    return found
