"""`tessera plan afd`: print a deployment plan and write a topology file `tessera up` runs.

With --profile (from `tessera profile`), it plans for this machine: BALANCE gives the
attention nodes per expert node, and the simulator, fed by the profile, picks the micro-batch
count m and batch B with the best predicted throughput under the SLO. The topology it writes
carries B (max_num_seqs, a step budget and a KV cache for B requests of --context-len
tokens), so `tessera up` runs the plan as planned. Without --profile, it runs
Algorithm 1 for a GPU-scale model over MegaScale-Infer's GPU table, homogeneous and
heterogeneous pairs (docs/design/disaggregation.md#plan-search). Both are predictions; the
measured numbers are in docs/benchmarks/disaggregation.md.
"""
from __future__ import annotations

import json
import pathlib

import yaml

from tessera.disagg import planner
from tessera.disagg.profile import profile_model, remake_command
from tessera.disagg.simulator import simulate
from tessera.machine_profiles import for_this_machine


def add_args(p) -> None:
    p.add_argument("--profile", default=None, help="plan for this machine from a `tessera profile` JSON")
    p.add_argument("--model", default="mixtral-8x22b", choices=sorted(planner.MODELS),
                   help="GPU-scale model shape (without --profile)")
    p.add_argument("--attention-gpus", default=",".join(planner.GPUS))
    p.add_argument("--expert-gpus", default=",".join(planner.GPUS))
    p.add_argument("--slo-ms", type=float, default=150.0, help="time between tokens limit")
    p.add_argument("--serve-model", default=None,
                   help="model the written topology serves (default: the one the profile measured)")
    p.add_argument("--context-len", type=int, default=1024,
                   help="tokens (prompt + completion) a request may hold: the KV cache holds B of them")
    p.add_argument("--out", default="afd-plan.yaml")


def plan_here(a) -> dict:
    """BALANCE gives the attention nodes per expert node (k1 / k3); then the simulator, fed by
    the profile, picks the (m, B) with the most tokens/s under the SLO for that deployment
    (the expert node serving each attention node's micro-batches in turn, as it does)."""
    taken = json.loads(pathlib.Path(a.profile).read_text()).get("taken", {})
    _, data = for_this_machine(a.profile, remake_command(taken))
    model = profile_model(data)
    n_a = max(1, round(model.t_a.slope / model.t_e.slope)) if model.t_e.slope > 0 else 1
    candidates = []
    for m in range(1, 5):
        for batch in (b for b in (8, 16, 32, 64, 128, 256, 512) if b >= m):
            t = simulate(model, batch, m, attention_nodes=n_a)
            candidates.append((n_a * batch / t, m, batch, t))
    feasible = [c for c in candidates if c[3] * 1e3 <= a.slo_ms]
    if not feasible:
        raise SystemExit(f"no (m, B) meets a {a.slo_ms} ms SLO on this profile")
    tok_s, m, batch, t_iter = max(feasible)
    print(f"plan (simulated from the measured profile): {n_a} attention node(s) per expert node (BALANCE, "
          f"k1 / k3 = {model.t_a.slope / max(model.t_e.slope, 1e-12):.2f}), m = {m}, batch {batch} per "
          f"attention node, predicted iteration {t_iter * 1e3:.1f} ms, {tok_s:.0f} tokens/s in all")
    return {"micro_batches": m, "attention_nodes": n_a, "expert_nodes": 1, "batch": batch}


def engine_limits(batch: int, context_len: int, block_size: int = 16) -> dict:
    """Topology options that make an attention node run the planned batch: B running requests,
    a step budget that fits B decode tokens with room for prefill, and a KV cache holding B
    requests of context_len tokens (so none is preempted)."""
    return {"max_num_seqs": batch, "max_num_batched_tokens": max(512, 2 * batch),
            "num_kv_blocks": batch * -(-context_len // block_size)}


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
    # The plan's times are the profiled model's: serve that model unless told otherwise.
    taken = json.loads(pathlib.Path(a.profile).read_text()).get("taken", {})
    topology = {
        "name": pathlib.Path(a.out).stem, "model": a.serve_model or taken.get("model", "random:mixtral"),
        "dtype": "float32",
        "transport": "auto",
        "roles": {"expert_node": {"replicas": plan["expert_nodes"], "port": 50071, "threads": 1},
                  "attention_node": {"replicas": plan["attention_nodes"], "port": 50061,
                                     "micro_batches": plan["micro_batches"], "threads": 1,
                                     **engine_limits(plan["batch"], a.context_len)},
                  "gateway": {"replicas": 1, "port": 8000}}}
    pathlib.Path(a.out).write_text(yaml.safe_dump(topology, sort_keys=False))
    print(f"wrote {a.out} (tessera up {a.out})")
    return 0
