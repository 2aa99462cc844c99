"""LLM-PQ's eleven cluster cases (from the prototype's run scripts;
docs/design/pipeline.md#paper-cases), planned with the roofline latency of each GPU's datasheet:
SIMULATED, no GPU is measured. For each case, LLM-PQ against the uniform, PipeEdge and adabits
baselines (predicted tokens/s and Σω), and the average and largest LLM-PQ throughput ratio over
each baseline. The paper's speed-ups came from real runs and cannot be reproduced here; these
are our cost models' own predictions.

Fixed assumptions: global batch 32, s = 512, n = 100 (case 2: s = 128, n = 200); the kernels the
prototype ran at each bit-width (roofline.KERNELS), its GPTQ layers quantized per output
channel (one scale and zero per row); ω with unit weight ranges (bit-width only: no OPT/BLOOM
weights here); devices of one type share a node and their datasheet interconnect, different
types talk over 100 Gb/s Ethernet; LLM-PQ's Σω is held at most the uniform plan's
(`quality_as_uniform`), so a speed-up is never bought with worse quality than the baseline's.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from typing import Any

from tessera.pipeline.costmodel import SHAPES, Link, MemoryModel
from tessera.pipeline.roofline import Roofline
from tessera.pipeline.devices import Cluster, Device, load_gpu_specs
from tessera.pipeline.ilp import Infeasible
from tessera.pipeline.plan import Plan
from tessera.pipeline.planner import CostModel, LatencyModel, Workload, plan_all, plan_method

BITS = (3, 4, 8, 16)
ETHERNET = Link(0.0, 100 / 8)          # 100 Gb/s between nodes


@dataclass(frozen=True)
class Case:
    number: int
    model: str
    devices: tuple[tuple[str, int], ...]     # (GPU type, count), in the run script's order
    prompt_len: int = 512
    gen_len: int = 100
    batch: int = 32

    def describe(self) -> str:
        return " + ".join(f"{n}x {t}" for t, n in self.devices)


CASES = (
    Case(1, "opt-13b", (("V100-32G", 1),)),
    Case(2, "opt-13b", (("V100-32G", 1),), prompt_len=128, gen_len=200),
    Case(3, "opt-30b", (("T4", 3), ("V100-32G", 1))),
    Case(4, "opt-30b", (("P100-12G", 3), ("V100-32G", 1))),
    Case(5, "opt-66b", (("T4", 4), ("V100-32G", 2))),
    Case(6, "opt-66b", (("V100-32G", 2), ("A100-40G", 2))),
    Case(7, "bloom-176b", (("V100-32G", 4), ("A100-40G", 4))),
    Case(8, "bloom-176b", (("V100-32G", 4), ("A100-80G", 2))),
    Case(9, "opt-30b", (("T4", 4),)),
    Case(10, "opt-66b", (("V100-32G", 4),)),
    Case(11, "bloom-176b", (("A100-80G", 4),)),
)


def cluster_for(case: Case) -> Cluster:
    specs = load_gpu_specs()
    devices = tuple(Device(f"{t}-{k}", t, specs[t].memory_gib, gpu=t) for t, n in case.devices for k in range(n))
    links = tuple((t, t, Link(0.0, specs[t].link_gbs)) for t, _ in case.devices)
    return Cluster(devices, links, ETHERNET, True)


def cost_for(case: Case) -> CostModel:
    shape = SHAPES[case.model]
    # LPTorch builds GPTQ layers with groupsize -1 (QuantLinear(bit, -1, ...), one scale and zero per
    # output row): a group as wide as the widest fan-in
    memory = MemoryModel(shape, group_size=max(fan_in for _, fan_in, _ in shape.linears()))
    unit = [sum(1 / (2 ** (b - 1) - 1) ** 2 for _ in shape.linears()) for b in BITS]
    latency: dict[str, LatencyModel] = {t: Roofline(load_gpu_specs()[t], memory) for t, _ in case.devices}
    return CostModel(shape.name, memory, latency, tuple(tuple(unit) for _ in range(shape.layers)), BITS, "llm-pq")


def run_case(case: Case, theta: float = 1.0, time_limit_s: float = 20.0, efficient: bool = False,
             objective: str = "paper", quality_as_uniform: bool = True) -> dict:
    """One case's row: per method its predicted tok/s, Σω, ξ, layout and solver status."""
    cluster, cost = cluster_for(case), cost_for(case)
    work = Workload(case.batch, case.prompt_len, case.gen_len, theta, objective=objective, time_limit_s=time_limit_s)
    if quality_as_uniform:
        try:
            work = replace(work, omega_cap=plan_method("uniform", cluster, cost, work).omega_sum)
        except Infeasible:
            pass
    plans = plan_all(cluster, cost, work, efficient)
    row: dict[str, Any] = {"case": case.number, "model": case.model, "devices": case.describe(), "s": case.prompt_len,
           "n": case.gen_len, "label": "simulated (roofline)", "methods": {}}
    for name, p in plans.items():
        row["methods"][name] = ({"tok_s": p.throughput_tok_s, "omega": p.omega_sum, "xi": p.xi, "layout": p.layout(),
                                 "status": p.status, "planning_s": p.planning_s}
                                if isinstance(p, Plan) else {"error": p})
    ours, *others = row["methods"].items()
    baselines = {name: m["tok_s"] for name, m in others if "tok_s" in m}
    if "tok_s" in ours[1]:
        row.update({f"vs_{name}": ours[1]["tok_s"] / tok_s for name, tok_s in baselines.items()})
        if baselines:
            row["vs_best_baseline"] = ours[1]["tok_s"] / max(baselines.values())
    return row


RATIOS = (("vs_uniform", "over uniform"), ("vs_pipeedge", "over PipeEdge"), ("vs_adabits", "over adabits"),
          ("vs_best_baseline", "over the best baseline"))


def summarize(rows: list[dict]) -> dict:
    """Average and largest LLM-PQ throughput ratio over each baseline, and over the best one."""
    out: dict[str, Any] = {"label": "simulated (roofline)"}
    for key, _ in RATIOS:
        ratios = [r[key] for r in rows if key in r]
        if ratios:
            out[key] = {"mean": statistics.mean(ratios), "max": max(ratios), "cases": len(ratios)}
    return out


def run_all(cases=CASES, **kw) -> tuple[list[dict], dict]:
    rows = [run_case(c, **kw) for c in cases]
    return rows, summarize(rows)


def print_table(rows: list[dict], summary: dict) -> None:
    print("LLM-PQ cluster cases -- SIMULATED: roofline latency from GPU datasheets, no GPU measured")
    names = list(rows[0]["methods"])
    print(f"{'case':>4s} {'model':10s} {'devices':26s} " + " ".join(f"{n[:18]:>18s}" for n in names) + "  vs uniform")
    for r in rows:
        cells = []
        for n in names:
            m = r["methods"][n]
            cells.append(f"{m['tok_s']:8.1f} Σω {m['omega']:6.3g}" if "tok_s" in m else f"{'no plan':>18s}")
        ratio = f"{r['vs_uniform']:.2f}x" if "vs_uniform" in r else "-"
        cols = " ".join(f"{c:>18s}" for c in cells)
        print(f"{r['case']:4d} {r['model']:10s} {r['devices']:26s} {cols}  {ratio}")
    for key, text in RATIOS:
        if key in summary:
            s = summary[key]
            print(f"LLM-PQ {text}: mean {s['mean']:.2f}x, max {s['max']:.2f}x ({s['cases']} cases, simulated)")


def main(a) -> int:
    rows, summary = run_all(theta=a.theta, time_limit_s=a.time_limit_s or 20.0, efficient=a.efficient,
                            objective=a.objective)
    if a.json:
        print(json.dumps({"rows": rows, "summary": summary}, indent=1))
    else:
        print_table(rows, summary)
    return 0
