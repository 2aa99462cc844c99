"""`tessera bench pq`: LLM-PQ's plan against its baselines, each MEASURED end to end here.

For the devices in --devices (virtual devices of this machine: a thread count, a memory budget
and `profile:` a `tessera profile pq` JSON), every planner method (llm-pq, uniform, pipeedge,
adabits) plans the offline workload (B prompts of s tokens, n generated each); each plan is
then run as a user would: its plan file and a pipeline topology (one stage per device, the
plan's layer ranges, threads and memory budget) are written, `tessera up` starts the stages and
the gateway, and `tessera run-batch --url` sends the B requests (greedy, ignore_eos) at once,
after one untimed batch (warm-up), --reps times (median), as B prompts to their first token
(max_tokens 1: the prefill) and as the whole batch (the decode steps are the difference).
The same at the --heldout workloads no plan was made for ("workloads": predicted against
measured for each). Rows {"plan", "measured_tok_s", "predicted_tok_s", "perplexity" (held-out,
the plan's per-layer bits: pipeline/quality.py), "workloads", ...}. "calibrated_s" adds one
overhead per prefill and per decode step fitted on --calibrate-on's runs ("calibrated_error_pct":
its error on the other plans; calibrate). "profiled_s" / "profiled_error_pct" take the overheads
from two reference deployments that are none of the plans (one stage and two equal stages, every
layer at 16 bits: `reference`), a + h·(stages − 1) per prefill and per decode step (`profiled`),
so every plan is predicted before any has run. Each workload's "stages" hold every stage's
compute seconds in its own layers during the batch against the model's per-stage prediction,
no overhead added ("stage_error_pct"). A plan whose stage refuses to start (its memory budget)
or whose run fails is a row with its error.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import yaml

from tessera.mtls.links import holding

TESSERA = [sys.executable, "-m", "tessera.cli"]
REFERENCE = "reference"


def add_args(p: argparse.ArgumentParser) -> None:
    from tessera.pipeline import plan_cli
    plan_cli.add_args(p)
    p.set_defaults(batch=8, prompt_len=64, gen_len=32, devices=None, out=None)
    next(x for x in p._actions if x.dest == "out").help = "also write a result file (tessera.bench.results)"
    p.add_argument("--methods", default="llm-pq,uniform,pipeedge,adabits")
    p.add_argument("--port", type=int, default=18200, help="the gateway's port (stages use the next ones)")
    p.add_argument("--ppl-windows", type=int, default=4)
    p.add_argument("--work-dir", default=None, help="where plans, topologies and results go (default: a temp dir)")
    p.add_argument("--startup-timeout-s", type=float, default=240.0)
    p.add_argument("--calibrate-on", default="uniform",
                   help="plan whose measured runs fit the per-step overheads the others are predicted with")
    p.add_argument("--heldout", default="4,64,32;8,32,48;6,48,40",
                   help="more workloads B,s,n;... each plan is measured and predicted at (never planned for)")
    p.add_argument("--reps", type=int, default=3, help="timed runs per workload (median)")


def requests_file(path: pathlib.Path, w: tuple[int, int, int], vocab: int, model_id: str, run: int) -> None:
    """B completions of exactly s prompt tokens (ids spread over the vocabulary), n tokens each;
    every run gets prompts of its own (the same ones again would be prefix-cache hits)."""
    batch, prompt_len, gen_len = w
    with path.open("w") as f:
        for r in range(batch):
            prompt = [(1000 + 7919 * (r * prompt_len + i) + 104729 * run) % (vocab - 200) + 100
                      for i in range(prompt_len)]
            body = {"model": model_id, "prompt": prompt, "max_tokens": gen_len, "temperature": 0, "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"r{r}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")


def run_batch(req: pathlib.Path, out: pathlib.Path, a: argparse.Namespace) -> float:
    """`tessera run-batch --url` on req: the seconds it reports from its first request to its
    last answer (its own start-up not counted); every line must succeed."""
    done = subprocess.run([*TESSERA, "run-batch", "-i", str(req), "-o", str(out), "--url",
                           f"http://127.0.0.1:{a.port}/v1"], check=True, capture_output=True, text=True)
    results = [json.loads(line) for line in out.read_text().splitlines()]
    bad = [r for r in results if r.get("error") or r["response"]["status_code"] != 200]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(results)} requests failed: {bad[0]}")
    match = re.search(r"tessera run-batch: .* failed in ([0-9.]+) s", done.stderr)
    if match is None:
        raise RuntimeError(f"run-batch did not report its time: {done.stderr[-300:]}")
    return float(match.group(1))


def stage_compute_s(port: int, stages: int, certs: pathlib.Path) -> list[float]:
    """Seconds each stage of the pipeline behind the gateway on `port` has spent in its own
    layers since it started (plan_topology puts stage j on port + 1 + j): stage 0, a worker,
    from its Info (as the gateway), the later stages from StageInfo (as a stage), with the
    certificates `tessera up --certs` runs them with."""
    from tessera.rpc.client import GrpcWorkerClient
    from tessera.rpc.pipeline_client import GrpcStageControl
    from tessera.worker_api import WorkerError

    async def first() -> float:
        client = GrpcWorkerClient(f"127.0.0.1:{port + 1}")
        try:
            return (await client.info()).stage_compute_s
        finally:
            await client.close()
    try:
        with holding(certs / "gateway"):
            out = [asyncio.run(first())]
        for j in range(1, stages):
            with holding(certs / "pipeline-shard"):
                control = GrpcStageControl(f"127.0.0.1:{port + 1 + j}")
            try:
                out.append(control.info().compute_s)
            finally:
                control.close()
    except WorkerError as e:     # the plan's row records it (RuntimeError), the bench goes on
        raise RuntimeError(f"reading the stages' compute seconds: {e}") from e
    return out


def run_plan(topo_file: pathlib.Path, workloads: list[tuple[int, int, int]], a: argparse.Namespace, vocab: int,
             model_id: str, stages: int) -> dict[tuple[int, int, int], tuple[float, float, tuple[float, ...]]]:
    """Per workload (B, s, n): the median seconds of (B prompts to their first token, the whole
    batch, each stage's compute during the whole batch) over --reps runs, against `tessera up
    topo_file` (started and stopped here). The first workload runs once untimed before anything
    is measured: a served stack's first batch pays one-off costs (oneDNN's weight reorders, the
    KV cache's first touch)."""
    log = topo_file.with_suffix(".log").open("w")
    certs = topo_file.with_suffix(".certs")
    subprocess.run([*TESSERA, "certs", str(topo_file), "--out", str(certs)], check=True, stdout=subprocess.DEVNULL)
    up = subprocess.Popen([*TESSERA, "up", str(topo_file), "--certs", str(certs)], stdout=log,
                          stderr=subprocess.STDOUT, start_new_session=True)
    out, req = topo_file.with_suffix(".results.jsonl"), topo_file.with_suffix(".requests.jsonl")
    runs = itertools.count()

    def timed(w: tuple[int, int, int]) -> float:
        requests_file(req, w, vocab, model_id, next(runs))
        return run_batch(req, out, a)

    def timed_stages(w: tuple[int, int, int]) -> tuple[float, list[float]]:
        before = stage_compute_s(a.port, stages, certs)
        seconds = timed(w)
        spent = [t1 - t0 for t0, t1 in zip(before, stage_compute_s(a.port, stages, certs))]
        if min(spent) < 0:
            raise RuntimeError(f"a stage restarted during the batch (its compute seconds went back: {spent})")
        return seconds, spent
    try:
        _wait_ready(f"http://127.0.0.1:{a.port}", up, a.startup_timeout_s, topo_file.with_suffix(".log"))
        timed(workloads[0])
        times = {}
        for w in workloads:
            first = [timed((*w[:2], 1)) for _ in range(a.reps)]
            whole = [timed_stages(w) for _ in range(a.reps)]
            times[w] = (statistics.median(first), statistics.median(t for t, _ in whole),
                        tuple(statistics.median(per[j] for _, per in whole) for j in range(stages)))
        return times
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
        log.close()


def _wait_ready(url: str, up: subprocess.Popen, timeout_s: float, log: pathlib.Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text()
        if up.poll() is not None or "giving up on" in text:   # e.g. a stage over its memory budget
            raise RuntimeError(f"tessera up failed: {text[-600:]}")
        try:
            if httpx.get(url + "/health/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"not ready in {timeout_s} s: {log.read_text()[-600:]}")


def deployment_files(plan, devices: dict, stem: pathlib.Path, a: argparse.Namespace) -> tuple[pathlib.Path, pathlib.Path]:
    """STEM.plan.json (the plan with its per-layer bits) and STEM.topology.yaml (what `tessera
    up` runs for it)."""
    from tessera.pipeline.plan_topology import plan_topology
    plan_file, topo_file = stem.with_suffix(".plan.json"), stem.with_suffix(".topology.yaml")
    plan_file.write_text(json.dumps({**plan.to_dict(), "bits": list(plan.layer_bits)}, indent=1))
    topo_file.write_text(yaml.safe_dump(plan_topology(plan, devices, plan_file, a.model, a.port), sort_keys=False))
    return plan_file, topo_file


def perplexity(model: str, plan_file: pathlib.Path, windows: int) -> float:
    import torch

    from tessera.models.loader import load_model
    from tessera.pipeline import quality
    from tessera.tokenizer import load_tokenizer
    net, _ = load_model(model, torch.bfloat16, quantization=str(plan_file))
    return quality.perplexity(net, quality.windows(load_tokenizer(model), "heldout", windows, 256))


def workloads(a: argparse.Namespace) -> list[tuple[int, int, int]]:
    """(B, s, n): the planned workload first, then the held-out ones (no larger than it in B or
    in s + n, so the plan's memory budgets and KV cache hold them)."""
    out = [(a.batch, a.prompt_len, a.gen_len)]
    if a.gen_len < 2:
        raise SystemExit("--gen-len must be >= 2: the decode steps are timed apart from the prefill")
    for part in filter(None, (a.heldout or "").split(";")):
        try:
            w = tuple(int(v) for v in part.split(","))
        except ValueError:
            w = ()
        if len(w) != 3 or min(w) < 1 or w[2] < 2 or w[0] > a.batch or w[1] + w[2] > a.prompt_len + a.gen_len:
            raise SystemExit(f"--heldout {part!r}: B,s,n with n >= 2 (a decode step to time), B <= {a.batch} and "
                             f"s + n <= {a.prompt_len + a.gen_len} (pass --heldout '' for none)")
        out.append(w)
    return list(dict.fromkeys(out))


def compare(plan, cluster, cost, work, measured: dict) -> list[dict]:
    """Predicted against measured, per workload: the prefill (to every prompt's first token),
    the n - 1 decode steps after it, and the whole batch."""
    from dataclasses import replace

    from tessera.pipeline.plan_topology import QUEUE_DELAY_MS
    from tessera.pipeline.planner import predict, stage_seconds
    rows = []
    for k, ((b, s, n), (first, whole, stages)) in enumerate(measured.items()):
        w = replace(work, batch=b, prompt_len=s, gen_len=n, gamma=1.0)   # ignore_eos: all n
        ev = predict(plan, cluster, cost, w)
        # Stage 0 waits QUEUE_DELAY_MS for a batch smaller than the plan's B (max_num_seqs).
        prefill = ev.prefill_s + (QUEUE_DELAY_MS / 1000 if b < plan.batch else 0.0)
        rows.append({"batch": b, "prompt_len": s, "gen_len": n, "heldout": k > 0,
                     "measured_prefill_s": round(first, 4), "predicted_prefill_s": round(prefill, 4),
                     "measured_decode_s": round(whole - first, 4), "predicted_decode_s": round(ev.decode_s, 4),
                     "measured_s": round(whole, 4), "predicted_s": round(prefill + ev.decode_s, 4),
                     "error_pct": round(100 * ((prefill + ev.decode_s) / whole - 1), 1),
                     # each stage's time in its own layers over the batch, against the model's
                     "stages": [{"measured_s": round(m, 4), "predicted_s": round(p, 4),
                                 "error_pct": round(100 * (p / m - 1), 1) if m > 0 else None}
                                for m, p in zip(stages, stage_seconds(plan, cluster, cost, w))]})
    return rows


def calibrate(rows: list[dict], on: str, key: str = "calibrated") -> dict | None:
    """The planner sums layer and link times; a served batch also pays the scheduler, sampler,
    detokenizer, gRPC and HTTP, and its stages share the machine's cores with them. Fit that on
    the `on` row's workloads, then predict every OTHER row's workloads with it (their errors
    are the cost model's end-to-end errors with the overheads measured elsewhere): one overhead
    per prefill (per batch) and one per decode step, each the mean of the `on` row's residuals.
    Written as KEY_s and KEY_error_pct (and by phase) beside each workload. (Not an affine
    prefill a + c * predicted: one plan's prefills span too short a range to fit a slope.)"""
    base = next((r for r in rows if r["plan"] == on and r.get("workloads")), None)
    if base is None:
        return None
    fixed, step = overheads(base)
    for r in rows:
        if r["plan"] != on:
            _apply(r, key, fixed, step)
    return {"plan": on, "prefill_overhead_ms": round(1000 * fixed, 2),
            "overhead_per_decode_step_ms": round(1000 * step, 2)}


def reference(plans: dict, cluster, cost, work, stages: int = 1) -> tuple:
    """A deployment the overheads are measured on, before any plan runs: `stages` stages of
    equal layer ranges, every layer at 16 bits, each on the first device's type and thread
    count, with no memory budget (a Plan, its devices and their cluster, for plan_topology and
    predict). One stage gives the overheads of a batch; two give what each more stage adds."""
    from dataclasses import replace

    from tessera.pipeline.devices import Cluster
    from tessera.pipeline.plan import Plan, Stage
    from tessera.pipeline.planner import predict
    like = cluster.devices[0]
    n = cost.memory.shape.layers
    devices = tuple(replace(like, name=f"{REFERENCE}-{j}", memory_gib=4.0) for j in range(stages))
    cuts = [round(j * n / stages) for j in range(stages + 1)]
    layout = tuple(Stage(d.name, like.type, a, b, (16,) * (b - a), 0.0, 0.0, 0.0, d.budget_bytes())
                   for d, a, b in zip(devices, cuts, cuts[1:]))
    xi = min(p.xi for p in plans.values() if not isinstance(p, str))
    plan = Plan(f"{REFERENCE}-{stages}", cost.name, work.batch, work.prompt_len, work.gen_len, xi,
                -(-work.batch // stages), layout, 0.0, 0.0, 0.0, 0.0, 0.0, "reference", "profiled")
    ring = Cluster(devices)
    ev = predict(plan, ring, cost, work)
    return replace(plan, prefill_s=ev.prefill_s, decode_s=ev.decode_s), devices, ring


def measure_reference(plans: dict, cluster, cost, work, stages: int, ws: list, a: argparse.Namespace,
                      work_dir: pathlib.Path, vocab: int, model_id: str) -> dict:
    """The reference deployment of `stages` stages served and compared like a plan: its row."""
    ref_plan, ref_devices, ref_cluster = reference(plans, cluster, cost, work, stages)
    row = {"plan": ref_plan.method, "stages": stages,
           "layout": f"{stages} stage(s) of equal layer ranges, every layer at 16 bits, no memory budget"}
    try:
        _, topo = deployment_files(ref_plan, {d.name: d for d in ref_devices}, work_dir / ref_plan.method, a)
        row["workloads"] = compare(ref_plan, ref_cluster, cost, work, run_plan(topo, ws, a, vocab, model_id, stages))
    except (RuntimeError, subprocess.CalledProcessError) as e:
        row["error"] = str(e)[-400:]
    return row


def overheads(row: dict) -> tuple[float, float]:
    """The mean residual of a measured row: seconds per prefill, seconds per decode step."""
    ws = row["workloads"]
    return (statistics.mean(w["measured_prefill_s"] - w["predicted_prefill_s"] for w in ws),
            statistics.mean((w["measured_decode_s"] - w["predicted_decode_s"]) / max(1, w["gen_len"] - 1)
                            for w in ws))


def profiled(rows: list[dict], refs: list[dict], key: str = "profiled") -> dict | None:
    """Every plan predicted with overheads measured on the reference deployments alone: per
    prefill and per decode step, a + h·(stages − 1), a from the one-stage reference and h from
    what the two-stage one pays more (a second process's transport, gRPC and Python on the same
    cores; with one reference, h = 0). Written as KEY_s and KEY_error_pct beside each workload."""
    by_stages = {r["stages"]: overheads(r) for r in refs if r.get("workloads")}
    if 1 not in by_stages:
        return None
    (p1, d1), (p2, d2) = by_stages[1], by_stages.get(2, by_stages[1])
    for r in rows:
        hops = r.get("stages", 1) - 1
        _apply(r, key, p1 + hops * (p2 - p1), d1 + hops * (d2 - d1))
    return {"prefill_overhead_ms": round(1000 * p1, 2), "prefill_per_hop_ms": round(1000 * (p2 - p1), 2),
            "overhead_per_decode_step_ms": round(1000 * d1, 2), "decode_step_per_hop_ms": round(1000 * (d2 - d1), 2),
            "reference_stages": sorted(by_stages)}


def _apply(row: dict, key: str, prefill_overhead: float, step_overhead: float) -> None:
    for w in row.get("workloads", ()):
        prefill = w["predicted_prefill_s"] + prefill_overhead
        decode = w["predicted_decode_s"] + (w["gen_len"] - 1) * step_overhead
        w[f"{key}_s"] = round(prefill + decode, 4)
        w[f"{key}_error_pct"] = round(100 * (w[f"{key}_s"] / w["measured_s"] - 1), 1)
        w[f"{key}_prefill_error_pct"] = round(100 * (prefill / w["measured_prefill_s"] - 1), 1)
        w[f"{key}_decode_error_pct"] = round(100 * (decode / w["measured_decode_s"] - 1), 1)


def summary(rows: list[dict]) -> dict:
    """Mean and largest |error| over every plan's workloads: raw, calibrated on one plan (the
    other plans), and with the overheads profiled on the reference deployments (every plan)."""
    out = {}
    keys = ["error_pct"] + [f"{k}_{part}error_pct" for k in ("calibrated", "profiled") for part in ("", "prefill_",
                                                                                                   "decode_")]
    for key in keys:
        errs = [abs(w[key]) for r in rows for w in r.get("workloads", ()) if key in w]
        if errs:
            out[key] = {"mean_abs": round(statistics.mean(errs), 1), "max_abs": max(errs), "points": len(errs)}
    stage_errs = [abs(st["error_pct"]) for r in rows for w in r.get("workloads", ()) for st in w.get("stages", ())
                  if st["error_pct"] is not None]
    if stage_errs:   # no overhead added: a stage's compute is what the model prices
        out["stage_error_pct"] = {"mean_abs": round(statistics.mean(stage_errs), 1), "max_abs": max(stage_errs),
                                  "points": len(stage_errs)}
    return out


def main(a: argparse.Namespace) -> int:
    from tessera.models.loader import load_config, model_id_for, resolve_model_path
    from tessera.pipeline import plan_cli
    from tessera.pipeline.planner import plan_all
    if not a.devices:
        raise SystemExit("--devices: a devices.yaml of virtual devices with `profile:` (see the README)")
    if a.reps < 1:
        raise SystemExit("--reps must be >= 1")
    ws = workloads(a)
    cluster, cost, work, notes = plan_cli.build(a)
    plans = plan_all(cluster, cost, work, efficient=a.efficient)
    work_dir = pathlib.Path(a.work_dir or tempfile.mkdtemp(prefix="bench-pq-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    vocab, model_id = load_config(resolve_model_path(a.model)).vocab_size, model_id_for(a.model)
    devices = {d.name: d for d in cluster.devices}
    rows, refs = [], [measure_reference(plans, cluster, cost, work, stages, ws, a, work_dir, vocab, model_id)
                      for stages in (1, 2)]
    for method, plan in plans.items():
        if method not in a.methods.split(","):
            continue
        row = {"plan": method, "stages": 0 if isinstance(plan, str) else len(plan.stages), "measured_tok_s": None,
               "predicted_tok_s": None if isinstance(plan, str) else round(plan.throughput_tok_s, 2)}
        if isinstance(plan, str):
            rows.append({**row, "error": plan})
            continue
        slug = method.replace(" ", "-").replace("(", "").replace(")", "")
        plan_file, topo_file = deployment_files(plan, devices, work_dir / slug, a)
        row.update(layout=plan.layout(), omega_sum=round(plan.omega_sum, 6),
                   perplexity=round(perplexity(a.model, plan_file, a.ppl_windows), 3))
        try:
            measured = run_plan(topo_file, ws, a, vocab, model_id, len(plan.stages))
            row.update(measured_tok_s=round(a.batch * a.gen_len / measured[ws[0]][1], 2),
                       workloads=compare(plan, cluster, cost, work, measured))
        except (RuntimeError, subprocess.CalledProcessError) as e:
            row["error"] = str(e)[-400:]
        rows.append(row)
    calibration = calibrate(rows, a.calibrate_on)
    profile = profiled(rows, refs)
    report = {"batch": a.batch, "prompt_len": a.prompt_len, "gen_len": a.gen_len, "notes": notes,
              "work_dir": str(work_dir), "calibration": calibration, "profiled_overhead": profile,
              "references": refs, "errors": summary(rows), "rows": rows}
    print(json.dumps(report, indent=1) if a.json else "\n".join(json.dumps(r) for r in [*rows, report["errors"]]))
    if a.out:
        from tessera.bench import results, rows as schema
        results.write(a.out, schema.pq(a, report))
    return 0
