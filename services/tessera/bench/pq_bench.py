"""`tessera bench pq`: LLM-PQ's plan against its baselines, each MEASURED end to end here.

For the devices in --devices (virtual devices of this machine: a thread count, a memory budget
and `profile:` a `tessera profile pq` JSON), every planner method (llm-pq, uniform, pipeedge,
adabits) plans the offline workload (B prompts of s tokens, n generated each); each plan is
then run as a user would: its plan file and a pipeline topology (one stage per device, the
plan's layer ranges, threads and memory budget) are written, `tessera up` starts the stages and
the gateway, and `tessera run-batch --url` sends the B requests (greedy, ignore_eos) at once.
Rows {"plan", "measured_tok_s", "predicted_tok_s", "perplexity", ...}; perplexity is held-out
(pipeline/quality.py) with the plan's per-layer bits; "calibrated_tok_s" adds one per-step
overhead fitted on --calibrate-on's run, and "calibrated_error_pct" is that prediction's error on
the other plans (see calibrate). A plan whose stage refuses to start (its
memory budget) or whose run fails is a row with its error.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import yaml

TESSERA = [sys.executable, "-m", "tessera.cli"]


def add_args(p: argparse.ArgumentParser) -> None:
    from tessera.pipeline import plan_cli
    plan_cli.add_args(p)
    p.set_defaults(batch=8, prompt_len=64, gen_len=32, devices=None)
    p.add_argument("--methods", default="llm-pq,uniform,pipeedge,adabits")
    p.add_argument("--port", type=int, default=18200, help="the gateway's port (stages use the next ones)")
    p.add_argument("--ppl-windows", type=int, default=4)
    p.add_argument("--work-dir", default=None, help="where plans, topologies and results go (default: a temp dir)")
    p.add_argument("--startup-timeout-s", type=float, default=240.0)
    p.add_argument("--calibrate-on", default="uniform",
                   help="plan whose measured run fits the per-step overhead the others are predicted with")


def requests_file(path: pathlib.Path, a: argparse.Namespace, vocab: int, model_id: str) -> None:
    """B completions of exactly s prompt tokens (ids spread over the vocabulary), n tokens each."""
    with path.open("w") as f:
        for r in range(a.batch):
            prompt = [(1000 + 7919 * (r * a.prompt_len + i)) % (vocab - 200) + 100 for i in range(a.prompt_len)]
            body = {"model": model_id, "prompt": prompt, "max_tokens": a.gen_len, "temperature": 0, "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"r{r}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")


def run_plan(topo_file: pathlib.Path, req: pathlib.Path, out: pathlib.Path, a: argparse.Namespace) -> float:
    """Seconds `run-batch --url` takes against `tessera up topo_file` (started and stopped here)."""
    log = topo_file.with_suffix(".log").open("w")
    up = subprocess.Popen([*TESSERA, "up", str(topo_file)], stdout=log, stderr=subprocess.STDOUT,
                          start_new_session=True)
    try:
        _wait_ready(f"http://127.0.0.1:{a.port}", up, a.startup_timeout_s, topo_file.with_suffix(".log"))
        start = time.perf_counter()
        subprocess.run([*TESSERA, "run-batch", "-i", str(req), "-o", str(out), "--url",
                        f"http://127.0.0.1:{a.port}/v1"], check=True, capture_output=True)
        wall = time.perf_counter() - start
        results = [json.loads(line) for line in out.read_text().splitlines()]
        bad = [r for r in results if r.get("error") or r["response"]["status_code"] != 200]
        if bad:
            raise RuntimeError(f"{len(bad)} of {len(results)} requests failed: {bad[0]}")
        return wall
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


def perplexity(model: str, plan_file: pathlib.Path, windows: int) -> float:
    import torch

    from tessera.models.loader import load_model
    from tessera.pipeline import quality
    from tessera.tokenizer import load_tokenizer
    net, _ = load_model(model, torch.bfloat16, quantization=str(plan_file))
    return quality.perplexity(net, quality.windows(load_tokenizer(model), "heldout", windows, 256))


def calibrate(rows: list[dict], batch: int, gen_len: int, on: str) -> dict | None:
    """The planner sums layer times; a served decode step also pays the scheduler, sampler,
    transport hops and the pipeline's fill/drain. Fit that as one overhead per decode step on
    the `on` plan's measured run, then predict the OTHER plans with it (held out: their error is
    the cost model's end-to-end error once calibrated on this machine)."""
    base = next((r for r in rows if r["plan"] == on and r.get("measured_tok_s")), None)
    if base is None:
        return None
    tokens = batch * gen_len
    overhead = (tokens / base["measured_tok_s"] - tokens / base["predicted_tok_s"]) / gen_len
    for r in rows:
        if r.get("predicted_tok_s"):
            r["calibrated_tok_s"] = round(tokens / (tokens / r["predicted_tok_s"] + gen_len * overhead), 2)
            if r.get("measured_tok_s") and r["plan"] != on:
                r["calibrated_error_pct"] = round(100 * (r["calibrated_tok_s"] / r["measured_tok_s"] - 1), 1)
    return {"plan": on, "overhead_per_decode_step_ms": round(1000 * overhead, 2)}


def main(a: argparse.Namespace) -> int:
    from tessera.models.loader import load_config, model_id_for, resolve_model_path
    from tessera.pipeline import plan_cli
    from tessera.pipeline.plan_topology import plan_topology
    from tessera.pipeline.planner import plan_all
    if not a.devices:
        raise SystemExit("--devices: a devices.yaml of virtual devices with `profile:` (see the README)")
    cluster, cost, work, notes = plan_cli.build(a)
    plans = plan_all(cluster, cost, work, efficient=a.efficient)
    work_dir = pathlib.Path(a.work_dir or tempfile.mkdtemp(prefix="bench-pq-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    req = work_dir / "requests.jsonl"
    requests_file(req, a, load_config(resolve_model_path(a.model)).vocab_size, model_id_for(a.model))
    devices = {d.name: d for d in cluster.devices}
    rows = []
    for method, plan in plans.items():
        if method not in a.methods.split(","):
            continue
        row = {"plan": method, "measured_tok_s": None,
               "predicted_tok_s": None if isinstance(plan, str) else round(plan.throughput_tok_s, 2)}
        if isinstance(plan, str):
            rows.append({**row, "error": plan})
            continue
        slug = method.replace(" ", "-").replace("(", "").replace(")", "")
        plan_file = work_dir / f"{slug}.plan.json"
        plan_file.write_text(json.dumps({**plan.to_dict(), "bits": list(plan.layer_bits)}, indent=1))
        topo_file = work_dir / f"{slug}.topology.yaml"
        topo_file.write_text(yaml.safe_dump(plan_topology(plan, devices, plan_file, a.model, a.port), sort_keys=False))
        row.update(layout=plan.layout(), omega_sum=round(plan.omega_sum, 6),
                   perplexity=round(perplexity(a.model, plan_file, a.ppl_windows), 3))
        try:
            wall = run_plan(topo_file, req, work_dir / f"{slug}.results.jsonl", a)
            row.update(measured_tok_s=round(a.batch * a.gen_len / wall, 2), wall_s=round(wall, 2))
        except (RuntimeError, subprocess.CalledProcessError) as e:
            row["error"] = str(e)[-400:]
        rows.append(row)
    calibration = calibrate(rows, a.batch, a.gen_len, a.calibrate_on)
    report = {"batch": a.batch, "prompt_len": a.prompt_len, "gen_len": a.gen_len, "notes": notes,
              "work_dir": str(work_dir), "calibration": calibration, "rows": rows}
    print(json.dumps(report, indent=1) if a.json else "\n".join(json.dumps(r) for r in rows))
    return 0
