"""`tessera bench afd`: fixed-batch decode throughput of attention-FFN disaggregation on a tiny
MoE, one attention node (core 0) and one expert node (core 1), one thread each, for m = 1, 2,
3 micro-batches, against the monolithic engine with two threads on both cores.

Measured (disagg.measure): per configuration a window of --steps decode steps of B requests
that all stay running (the run fails if one is preempted or finishes inside it); tokens are
those the engine emitted; T_a, T_e, T_c, T_o per layer and micro-batch, idle fractions.
Simulated, and labelled so:
- simulated_ms / simulation_error: the simulator fed by m = 1 calibration runs at every
  micro-batch size, taken right after the timed rows. The m = 1 row at B is one of its
  inputs, so its error is not reported (None): only m >= 2 rows are predictions.
- profile_simulated_ms / profile_error: the simulator fed by --profile, a `tessera profile`
  run taken separately (independent of this run, drift included; every row is a prediction).
- projection_simulated: M attention nodes feeding one expert node (MegaScale-Infer's answer
  to a lightly loaded expert), which two cores cannot measure fairly; predicted only.
"""
from __future__ import annotations

import json
import pathlib
import sys

from tessera.disagg.measure import BENCH_MODEL, Window, afd_row, expert_node, monolithic_row
from tessera.disagg.profile import build_profile, load_profile, profile_model, profile_row, profile_sizes
from tessera.disagg.simulator import simulate


def add_args(p) -> None:
    p.add_argument("--model", default=BENCH_MODEL)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=48, help="decode steps timed per configuration")
    p.add_argument("--micro-batches", default="1,2,3")
    p.add_argument("--transport", default="auto", choices=["auto", "nixl", "tcp"])
    p.add_argument("--json", action="store_true")
    p.add_argument("--profile", default=None,
                   help="a `tessera profile` JSON taken separately (same --model, --batch, --micro-batches): "
                        "its simulated times and errors are reported beside the calibrated ones")
    p.add_argument("--project-attention-nodes", default="2,3,4",
                   help="M values for the simulated projection of M attention nodes -> 1 expert node")
    from tessera.bench.results import add_out_arg
    add_out_arg(p)


def measure_rows(a, window: Window, micro_batches: list[int]) -> tuple[list[dict], list[dict]]:
    """(AFD rows, m = 1 calibration samples at every micro-batch size), back to back on one
    expert process."""
    rows = []
    with expert_node(a.model, a.transport) as address:
        for m in micro_batches:
            rows.append(afd_row(a.model, window, m, address, a.transport))
            if not a.json:
                print(_line(rows[-1]), flush=True)
        samples = [profile_row(r) for r in rows if r["micro_batches"] == 1]
        for b in sorted(set(profile_sizes(a.batch, micro_batches)) - {s["batch"] for s in samples}):
            samples.append(profile_row(afd_row(a.model, Window(b, a.prompt_len, a.steps), 1, address, a.transport)))
    return rows, sorted(samples, key=lambda s: s["batch"])


def add_simulation(rows: list[dict], mono: dict, calibrated, independent, batch: int) -> None:
    """Simulated times and relative errors beside each measured row, and the speed-ups the
    issue's targets are stated in."""
    base = next((r["output_tok_s"] for r in rows if r["micro_batches"] == 1), None)
    for r in rows:
        m = r["micro_batches"]
        r["simulated_ms"] = round(1e3 * simulate(calibrated, batch, m), 2)
        r["simulation_error"] = None if m == 1 else _error(r["simulated_ms"], r["iteration_ms"])
        if independent is not None:
            r["profile_simulated_ms"] = round(1e3 * simulate(independent, batch, m), 2)
            r["profile_error"] = _error(r["profile_simulated_ms"], r["iteration_ms"])
        r["vs_m1"] = round(r["output_tok_s"] / base, 3) if base else None
        r["vs_monolithic"] = round(r["output_tok_s"] / mono["output_tok_s"], 3)


def _error(simulated: float, measured: float) -> float:
    return round(simulated / measured - 1, 3)


def projection(model, batch: int, m: int, nodes: list[int]) -> list[dict]:
    """M attention nodes with B requests each feeding one expert node (cores: M + 1), with the
    expert computing each node's micro-batch alone (as Tessera's expert node does) or all
    nodes' micro-batch i as one computation (MegaScale-Infer). Expert sizes beyond the
    profile's largest batch come from its linear fit."""
    out = []
    for M in nodes:
        for aggregate in (False, True):
            t = simulate(model, batch, m, attention_nodes=M, aggregate=aggregate)
            out.append({"attention_nodes": M, "expert_nodes": 1,
                        "expert": "aggregated" if aggregate else "per attention node",
                        "iteration_ms": round(1e3 * t, 2), "output_tok_s": round(M * batch / t, 1),
                        "tok_s_per_core": round(M * batch / t / (M + 1), 1)})
    return out


def _independent_profile(a):
    if not a.profile:
        return None
    data = json.loads(pathlib.Path(a.profile).read_text())
    taken = data.get("taken", {})
    if taken.get("model", a.model) != a.model:
        raise SystemExit(f"{a.profile} was taken with --model {taken['model']}, not {a.model}")
    for key in ("prompt_len", "steps"):
        if key in taken and taken[key] != getattr(a, key):
            print(f"warning: {a.profile} was taken with --{key.replace('_', '-')} {taken[key]}", file=sys.stderr)
    return load_profile(a.profile)


def main(a) -> int:
    from tessera.disagg.measure import FixedBatchError
    from tessera.models.loader import resolve_model_path
    resolve_model_path(a.model)
    independent = _independent_profile(a)
    window = Window(a.batch, a.prompt_len, a.steps)
    micro_batches = [int(x) for x in a.micro_batches.split(",")]
    try:
        mono = monolithic_row(a.model, window)
        if not a.json:
            print(_line(mono), flush=True)
        rows, samples = measure_rows(a, window, micro_batches)
    except FixedBatchError as e:
        print(f"bench afd: not fixed-batch decode: {e}", file=sys.stderr)
        return 1
    calibrated = profile_model(build_profile(samples, rows[0]["layers"]))
    add_simulation(rows, mono, calibrated, independent, a.batch)
    nodes = [int(x) for x in a.project_attention_nodes.split(",") if x]
    for r in rows:
        r["projection_simulated"] = projection(independent or calibrated, a.batch, r["micro_batches"], nodes)
    if a.out:
        from tessera.bench import results, rows as schema
        results.write(a.out, schema.afd(a, mono, rows))
    if a.json:
        print(json.dumps([mono, *rows], indent=1))
    else:
        _report(mono, rows, "independent profile" if independent else "calibration runs")
    return 0


def _line(r: dict) -> str:
    keys = ("mode", "micro_batches", "batch", "output_tokens", "output_tok_s", "iteration_ms", "t_a_ms",
            "t_e_ms", "t_c_ms", "t_o_ms", "attention_idle", "expert_idle")
    return "  ".join(f"{k} {r[k]}" for k in keys if k in r)


def _report(mono: dict, rows: list[dict], source: str) -> None:
    print(f"\nmeasured: monolithic (2 threads) {mono['output_tok_s']} tok/s at batch {mono['batch']}")
    print(" m  tok/s    vs m=1  vs mono  iter ms  sim(calibr.) err     sim(profile) err")
    for r in rows:
        print(f"{r['micro_batches']:>2}  {r['output_tok_s']:>7}  {r['vs_m1']!s:>6}  {r['vs_monolithic']:>7}  "
              f"{r['iteration_ms']:>7}  {r['simulated_ms']:>12} {r['simulation_error']!s:>6}  "
              f"{r.get('profile_simulated_ms', '-')!s:>12} {r.get('profile_error', '-')!s:>6}")
    print("(calibration error of m = 1 not shown: that row is one of the simulator's inputs)")
    print(f"\nSIMULATED, not measured (from the {source}): M attention nodes -> 1 expert node, "
          f"batch {mono['batch']} per attention node")
    for r in rows:
        for p in r["projection_simulated"]:
            print(f"  m = {r['micro_batches']}  M = {p['attention_nodes']}  expert {p['expert']:<18}  "
                  f"{p['output_tok_s']:>8} tok/s  {p['tok_s_per_core']:>7} tok/s per core  "
                  f"iteration {p['iteration_ms']} ms")
