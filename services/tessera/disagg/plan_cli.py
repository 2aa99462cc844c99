"""`tessera plan afd`: print a deployment plan and write a topology file `tessera up` runs.

With --profile (from `tessera profile`), it plans for this machine: the simulator, fed by the
measured fits, picks the micro-batch count m and batch B with the best predicted throughput
under the SLO, and BALANCE gives the attention nodes per expert node. Without it, it runs
Algorithm 1 for a GPU-scale model over papers.md §1.5's GPU table (homogeneous and
heterogeneous pairs). Both are predictions; the README says which numbers were measured.
"""
from __future__ import annotations

import pathlib

import yaml

from tessera.disagg import planner
from tessera.disagg.profile import load_profile
from tessera.disagg.simulator import simulate


def add_args(p) -> None:
    p.add_argument("--profile", default=None, help="plan for this machine from a `tessera profile` JSON")
    p.add_argument("--model", default="mixtral-8x22b", choices=sorted(planner.MODELS),
                   help="GPU-scale model shape (without --profile)")
    p.add_argument("--attention-gpus", default=",".join(planner.GPUS))
    p.add_argument("--expert-gpus", default=",".join(planner.GPUS))
    p.add_argument("--slo-ms", type=float, default=150.0, help="time between tokens limit")
    p.add_argument("--serve-model", default=None, help="model the written topology serves (with --profile)")
    p.add_argument("--out", default="afd-plan.yaml")


def plan_here(a) -> dict:
    model = load_profile(a.profile)
    candidates = [(B / simulate(model, B, m), m, B, simulate(model, B, m))
                  for m in range(1, 5) for B in (8, 16, 32, 64, 128, 256, 512) if B >= m]
    feasible = [c for c in candidates if c[3] * 1e3 <= a.slo_ms]
    if not feasible:
        raise SystemExit(f"no (m, B) meets a {a.slo_ms} ms SLO on this profile")
    tok_s, m, batch, t_iter = max(feasible)
    n_a = max(1, round(model.t_a.slope / model.t_e.slope)) if model.t_e.slope else 1
    print(f"plan (simulated from the measured profile): m = {m}, batch {batch} per attention node, "
          f"predicted iteration {t_iter * 1e3:.1f} ms, {tok_s:.0f} tokens/s per attention node; "
          f"BALANCE: {n_a} attention node(s) per expert node (k1 / k3 = "
          f"{model.t_a.slope / max(model.t_e.slope, 1e-12):.2f})")
    return {"micro_batches": m, "attention_nodes": n_a, "expert_nodes": 1, "batch": batch}


def plan_gpu(a) -> None:
    shape = planner.MODELS[a.model]
    for label, att, exp in (("homogeneous", None, None),
                            ("heterogeneous", a.attention_gpus.split(","), a.expert_gpus.split(","))):
        pairs = [([g], [g]) for g in planner.GPUS] if att is None else [(att, exp)]
        plans = [p for p in (planner.search(shape, x, y, a.slo_ms / 1e3) for x, y in pairs) if p]
        best = max(plans, key=lambda p: p.tpuc) if plans else None
        if best is None:
            print(f"{label}: no plan meets the SLO")
            continue
        print(f"{label} ({shape.name}, simulated): attention {best.attention_gpu} tp {best.tp_a} x "
              f"{best.n_a} nodes, experts {best.expert_gpu} tp {best.tp_e} x {shape.experts}, m = {best.m}, "
              f"B = {best.batch}: T_a {best.t_a * 1e3:.2f} ms, T_e {best.t_e * 1e3:.2f} ms, "
              f"T_c {best.t_c * 1e3:.3f} ms, iteration {best.t_total * 1e3:.1f} ms, "
              f"{best.throughput:.0f} tok/s, {best.tpuc:.0f} tok/s per cost unit")


def main(a) -> int:
    if a.profile is None:
        plan_gpu(a)
        return 0
    plan = plan_here(a)
    topology = {
        "name": pathlib.Path(a.out).stem, "model": a.serve_model or "random:mixtral", "dtype": "float32",
        "transport": "auto",
        "roles": {"expert_node": {"replicas": plan["expert_nodes"], "port": 50071, "threads": 1},
                  "attention_node": {"replicas": plan["attention_nodes"], "port": 50061,
                                     "micro_batches": plan["micro_batches"], "threads": 1},
                  "gateway": {"replicas": 1, "port": 8000}}}
    pathlib.Path(a.out).write_text(yaml.safe_dump(topology, sort_keys=False))
    print(f"wrote {a.out} (tessera up {a.out})")
    return 0
