"""`tessera profile`: measure T_a(b), T_e(b), T_c(b) and T_o(b) on this machine and fit the
linear models the planner and the simulator use (MegaScale-Infer §4.2: T_a = k1 b + k2,
T_e = k3 b + k4; T_c and T_o are fitted the same way).

The measurements are AFD decode runs with m = 1 (nothing overlaps, so the attention side's
wait per layer is exactly 2 T_c + T_e) at several batch sizes, one attention process and one
expert process, each on its own core with one thread — the same set-up as `bench afd`, so the
simulator can be checked against that benchmark's m = 2, 3 rows, which the fit never saw.
"""
from __future__ import annotations

import json
import os
import pathlib

from tessera.disagg.simulator import Linear, Measured, StepModel


def fit(xs: list[float], ys: list[float]) -> Linear:
    """Least-squares line through (x, y); intercept clamped at >= 0."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return Linear(max(0.0, slope), max(0.0, my - max(0.0, slope) * mx))


def build_profile(rows: list[dict], layers: int) -> dict:
    b = [r["batch"] for r in rows]
    fits = {k: fit(b, [r[f"{k}_ms"] / 1e3 for r in rows]) for k in ("t_a", "t_e", "t_c", "t_o")}
    return {"layers": layers, "samples": rows,
            "fits": {k: {"slope_s_per_token": v.slope, "intercept_s": v.intercept} for k, v in fits.items()}}


def profile_row(batch: int, row: dict) -> dict:
    """A profile sample from an m = 1 `bench afd` row."""
    return {"batch": batch, **{k: row[k] for k in ("t_a_ms", "t_e_ms", "t_c_ms", "t_o_ms", "iteration_ms", "layers")}}


def load_profile(path: str | os.PathLike) -> StepModel:
    return profile_model(json.loads(pathlib.Path(path).read_text()))


def profile_model(data: dict) -> StepModel:
    """The profile's times as functions of b: its measurements, interpolated, and its fits."""
    samples = sorted(data.get("samples", []), key=lambda r: r["batch"])
    f = {k: Measured(tuple((r["batch"], r[f"{k}_ms"] / 1e3) for r in samples),
                     Linear(v["slope_s_per_token"], v["intercept_s"])) for k, v in data["fits"].items()}
    return StepModel(f["t_a"], f["t_e"], f["t_c"], f["t_o"], data["layers"])


def add_args(p) -> None:
    from tessera.bench.afd_bench import BENCH_MODEL
    p.add_argument("--model", default=BENCH_MODEL)
    p.add_argument("--batches", default="8,16,32,64,128,256")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=48, help="decode steps per batch size (as bench afd: "
                   "the same context lengths)")
    p.add_argument("--transport", default="auto", choices=["auto", "nixl", "tcp"])
    p.add_argument("--out", default="afd-profile.json")


def main(a) -> int:
    import subprocess
    from types import SimpleNamespace

    import torch

    from tessera.bench.afd_bench import _expert_process, afd_row
    from tessera.bench.m2n_bench import _free_port
    from tessera.models.loader import resolve_model_path
    resolve_model_path(a.model)
    port = _free_port()
    expert = _expert_process(a, port)
    rows = []
    try:
        os.sched_setaffinity(0, {0})
        torch.set_num_threads(1)
        for batch in [int(x) for x in a.batches.split(",")]:
            args = SimpleNamespace(model=a.model, batch=batch, prompt_len=a.prompt_len, steps=a.steps,
                                   transport=a.transport)
            rows.append(profile_row(batch, afd_row(args, 1, f"127.0.0.1:{port}")))
            print(rows[-1], flush=True)
    finally:
        expert.terminate()
        try:
            expert.wait(timeout=20)
        except subprocess.TimeoutExpired:
            expert.kill()
    profile = build_profile(rows, rows[0]["layers"])
    pathlib.Path(a.out).write_text(json.dumps(profile, indent=1))
    print(f"wrote {a.out}: " + ", ".join(f"{k} = {v['slope_s_per_token'] * 1e6:.1f} us/token + "
                                          f"{v['intercept_s'] * 1e3:.2f} ms" for k, v in profile["fits"].items()))
    return 0
