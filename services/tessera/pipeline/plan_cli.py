"""`tessera plan pq`: LLM-PQ's plan for a device inventory, beside the PipeEdge, uniform and
adabits baselines planned in the same framework; writes the plan as JSON (the pipeline runtime
reads its "bits" and "stages"). `--paper-cases` plans LLM-PQ's eleven GPU clusters instead
(paper_cases.py; docs/design/pipeline.md#paper-cases). Every time and throughput printed is a
prediction of the cost models: 'profiled' where a device's latency comes from `tessera profile pq`,
'simulated (roofline)' where it comes from a GPU's datasheet.

ω (the quality indicator) comes from --indicator (`tessera indicator`'s JSON: {"bits": [...],
"omega": [[per bit] per layer]}). Without one, a fallback of the paper's formula with unit
input variance: ω[l, b] = Σ_linears (max row range / (2^(b-1) - 1))², from the checkpoint's
weights, or, for a built-in shape without weights, the same with unit ranges (ω depends on
the bit-width only). The output says which was used.
"""
from __future__ import annotations

import json
import pathlib
from dataclasses import replace

from tessera.machine_profiles import for_this_machine
from tessera.pipeline.costmodel import SHAPES, MemoryModel, ModelShape, ProfiledLatency, shape_from_config
from tessera.pipeline.roofline import Roofline
from tessera.pipeline.devices import Cluster, load_cluster, load_gpu_specs
from tessera.pipeline.ilp import Infeasible
from tessera.pipeline.plan import Plan, PlanError, validate
from tessera.pipeline.profile import remake_command
from tessera.pipeline.planner import CostModel, LatencyModel, Workload, plan_all, plan_method


def add_args(p) -> None:
    p.add_argument("--devices", help="device inventory (devices.yaml: see pipeline/devices.py)")
    p.add_argument("--model", default="smollm2",
                   help=f"'smollm2', a checkpoint path, or a built-in shape: {', '.join(SHAPES)}")
    p.add_argument("--batch", type=int, help="global batch B")
    p.add_argument("--prompt-len", type=int, help="prompt length s")
    p.add_argument("--gen-len", type=int, help="generated tokens n")
    p.add_argument("--theta", type=float, default=1.0,
                   help="quality weight: seconds of predicted batch time worth the whole model at its lowest "
                        "bit-width (ω is normalized by that); default 1.0")
    p.add_argument("--gamma", type=float, default=1.0, help="expected share of n generated (μ_n = γ n)")
    p.add_argument("--objective", default="paper", choices=["paper", "rounds"],
                   help="the ILP's decode term: the paper's, or μ_n-1 pipeline rounds (see pipeline/ilp.py)")
    p.add_argument("--time-limit-s", type=float, default=None,
                   help="per ILP solve (default 60; 20 with --paper-cases, the prototype's shortest)")
    p.add_argument("--gap", type=float, default=0.0, help="relative optimality gap CBC may stop at")
    p.add_argument("--efficient", action="store_true", help="the straggler/pioneer heuristic instead of the ILP")
    p.add_argument("--quality-as-uniform", action="store_true",
                   help="LLM-PQ's Σω at most the uniform plan's (compare at no worse quality)")
    p.add_argument("--indicator", default=None, help="ω JSON from `tessera indicator`")
    p.add_argument("--bits", default="3,4,8,16", help="bit-widths to plan with (without --indicator)")
    p.add_argument("--group-size", type=int, default=32, help="int4/int3 quantization group (memory model)")
    p.add_argument("--out", default="plan.json")
    p.add_argument("--topology", default=None, help="also write a topology file that `tessera up` runs (profiled "
                                                   "devices: one pipeline stage each on this machine)")
    p.add_argument("--paper-cases", action="store_true", help="plan LLM-PQ's 11 GPU clusters (simulated)")
    p.add_argument("--json", action="store_true", help="with --paper-cases: print JSON")


def model_shape(model: str) -> tuple[ModelShape, bool]:
    """(shape, whether weights exist to compute a fallback ω from)."""
    if model in SHAPES:
        return SHAPES[model], False
    from tessera.models.loader import load_config, resolve_model_path
    return shape_from_config(model, load_config(resolve_model_path(model))), True


def latency_models(cluster: Cluster, memory: MemoryModel) -> dict[str, LatencyModel]:
    """One latency model per device type; the devices of a type must agree on its source."""
    out: dict[str, LatencyModel] = {}
    source: dict[str, str | None] = {}
    for d in cluster.devices:
        key = d.profile or d.gpu
        if source.setdefault(d.type, key) != key:
            raise SystemExit(f"devices of type {d.type} name different latency sources ({source[d.type]}, {key})")
        if d.type not in out:
            if d.profile:
                used, data = for_this_machine(d.profile, remake_command(json.loads(pathlib.Path(d.profile).read_text())))
                where = f"{data.get('cpu', '?')}, {data.get('threads')} thread(s)"
                try:
                    out[d.type] = ProfiledLatency.from_profile(data, where)
                except ValueError as e:
                    raise SystemExit(f"{used}: {e}") from None
            else:
                out[d.type] = Roofline(load_gpu_specs()[str(d.gpu)], memory)
    return out


def weight_range_omega(model: str, bits: list[int]) -> list[list[float]]:
    """The fallback ω: the paper's formula with unit input variance, from the weights."""
    import torch

    from tessera.layers.quant import layer_linears
    from tessera.models.loader import load_model
    net, _ = load_model(model, torch.float32)
    rows = []
    for layer in net.layers:
        ranges = [float((w.amax(dim=1) - w.amin(dim=1)).max()) for w in (m.weight for _, m in layer_linears(layer))]
        rows.append([sum((r / (2 ** (b - 1) - 1)) ** 2 for r in ranges) for b in bits])
    return rows


def load_omega(a, shape: ModelShape, has_weights: bool, bits: list[int]) -> tuple[list[list[float]], str]:
    if a.indicator:
        data = json.loads(pathlib.Path(a.indicator).read_text())
        given = [int(b) for b in data["bits"]]
        missing = sorted(set(bits) - set(given))
        if missing or len(data["omega"]) != shape.layers:
            raise SystemExit(f"{a.indicator}: needs {shape.layers} layers and bit-widths {bits} (has {given})")
        return [[row[given.index(b)] for b in bits] for row in data["omega"]], f"indicator {a.indicator}"
    if has_weights:
        return weight_range_omega(a.model, bits), "fallback: weight ranges, unit input variance (no --indicator)"
    unit = [sum(1 / (2 ** (b - 1) - 1) ** 2 for _ in shape.linears()) for b in bits]
    return ([list(unit) for _ in range(shape.layers)],
            "fallback: unit weight ranges, ω by bit-width only (no --indicator)")


def planning_bits(a, models: dict) -> tuple[list[int], list[str]]:
    wanted = ([int(b) for b in json.loads(pathlib.Path(a.indicator).read_text())["bits"]] if a.indicator
              else [int(b) for b in a.bits.split(",")])
    usable = [b for b in wanted if all(b in m.bits for m in models.values())]
    notes = [f"bit-widths {sorted(set(wanted) - set(usable))} dropped: no latency model for them on every "
             "device type"] if len(usable) < len(wanted) else []
    if not usable:
        raise SystemExit(f"no bit-width of {wanted} has a latency model on every device type")
    return sorted(usable), notes


def build(a) -> tuple[Cluster, CostModel, Workload, list[str]]:
    cluster = load_cluster(a.devices)
    shape, has_weights = model_shape(a.model)
    memory = MemoryModel(shape, a.group_size, int3_as_int4=any(d.profile for d in cluster.devices))
    models = latency_models(cluster, memory)
    bits, notes = planning_bits(a, models)
    omega, source = load_omega(a, shape, has_weights, bits)
    work = Workload(a.batch, a.prompt_len, a.gen_len, a.theta, a.gamma, a.objective, a.time_limit_s or 60.0, a.gap)
    notes.append(f"ω: {source}")
    if not cluster.links_given:
        notes.append("communication: not modelled (devices.yaml gives no links)")
    n = len(cluster.devices)
    for t, m in models.items():
        b_dec = -(-work.batch // n)         # ξ is at most the decode micro-batch
        outside = m.outside(b_dec, work.prompt_len, b_dec, work.mu_n // 2)
        if outside:
            notes.append(f"{t}: {', '.join(outside)} outside the profiled range: times clamped to its edge")
    return cluster, CostModel(shape.name, memory, models, tuple(map(tuple, omega)), tuple(bits)), work, notes


def print_plans(plans: dict[str, Plan | str], notes: list[str]) -> None:
    ref = plans.get("uniform")
    print(f"{'method':20s} {'tok/s':>9s} {'vs uniform':>10s} {'Σω':>10s} {'ξ':>3s} {'plan s':>7s}  stages")
    for name, p in plans.items():
        if isinstance(p, str):
            print(f"{name:20s} {'-':>9s} {'':>10s} {'':>10s} {'':>3s} {'':>7s}  {p}")
            continue
        ratio = f"{p.throughput_tok_s / ref.throughput_tok_s:.2f}x" if isinstance(ref, Plan) else "-"
        print(f"{name:20s} {p.throughput_tok_s:9.1f} {ratio:>10s} {p.omega_sum:10.4g} {p.xi:3d} {p.planning_s:7.1f}  "
              f"{p.layout()}  [{p.status}]")
    labels = sorted({p.label for p in plans.values() if isinstance(p, Plan)})
    print("predicted by the cost models (" + "; ".join(labels) + ")")
    for note in notes:
        print(f"note: {note}")


def main(a) -> int:
    if a.paper_cases:
        from tessera.pipeline.paper_cases import main as cases_main
        return cases_main(a)
    if not (a.devices and a.batch and a.prompt_len and a.gen_len):
        raise SystemExit("tessera plan pq needs --devices, --batch, --prompt-len and --gen-len (or --paper-cases)")
    cluster, cost, work, notes = build(a)
    if a.quality_as_uniform:
        try:
            work = replace(work, omega_cap=plan_method("uniform", cluster, cost, work).omega_sum)
            notes.append(f"LLM-PQ: Σω at most the uniform plan's ({work.omega_cap:.4g})")
        except Infeasible:
            notes.append("--quality-as-uniform ignored: no uniform plan fits")
    plans = plan_all(cluster, cost, work, a.efficient)
    devices = {d.name: d for d in cluster.devices}
    for name, p in list(plans.items()):
        if isinstance(p, Plan):
            try:
                validate(p, cost.memory.shape.layers, cost.memory, devices, cost.bits, cost.head_stage(len(p.stages)))
            except PlanError as e:
                plans[name] = f"INVALID: {e}"
    print_plans(plans, notes)
    best = next(iter(plans.values()))
    if not isinstance(best, Plan):
        raise SystemExit(f"no LLM-PQ plan: {best}")
    doc = {**best.to_dict(), "bits": list(best.layer_bits), "omega_bits": list(cost.bits), "theta": work.theta,
           "notes": notes, "baselines": {k: (v.to_dict() if isinstance(v, Plan) else v)
                                         for k, v in list(plans.items())[1:]}}
    pathlib.Path(a.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {a.out}")
    if a.topology:
        import yaml

        from tessera.pipeline.plan_topology import plan_topology
        topo = plan_topology(best, devices, pathlib.Path(a.out).resolve(), a.model)
        pathlib.Path(a.topology).write_text(yaml.safe_dump(topo, sort_keys=False))
        print(f"wrote {a.topology} (tessera up {a.topology})")
    return 0
