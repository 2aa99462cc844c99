"""`tessera profile`: measure T_a(b), T_e(b), T_c(b) and T_o(b) on this machine and fit the
linear models the planner and the simulator use (MegaScale-Infer §4.2: T_a = k1 b + k2,
T_e = k3 b + k4; T_c and T_o are fitted the same way).

The measurements are fixed-batch AFD decode windows (disagg.measure) with m = 1 (nothing
overlaps, so the attention side's wait per layer is exactly 2 T_c + T_e), one attention
process and one expert process, each on its own core with one thread: the set-up of `bench
afd`. They are taken at every micro-batch size the simulator uses for that bench's batch B
(floor(B/m), floor(B/m) + 1) and a few small sizes for the fits. Run separately from the
bench, the profile is an independent input: `bench afd --profile FILE` reports the
simulator's error against it.
"""
from __future__ import annotations

import json
import os
import pathlib

from tessera.disagg.measure import BENCH_MODEL, Window, afd_row, expert_node
from tessera.disagg.simulator import Linear, Measured, StepModel, micro_batch_sizes
from tessera.machine_profiles import recorded_machine


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


def profile_row(row: dict) -> dict:
    """A profile sample from an m = 1 AFD row (disagg.measure.afd_row)."""
    return {k: row[k] for k in ("batch", "t_a_ms", "t_e_ms", "t_c_ms", "t_o_ms", "iteration_ms", "layers")}


def profile_sizes(batch: int, micro_batches: list[int], extra: list[int] = ()) -> list[int]:
    """Every micro-batch size the simulator asks about for `batch` split m ways (so it
    interpolates nothing there), plus `extra` points for the linear fits."""
    return sorted({b for m in micro_batches for b in micro_batch_sizes(batch, m)} | set(extra))


def remake_command(taken: dict) -> str:
    """The command that measures a profile taken with these settings again on this machine."""
    flags = {"model": "--model", "batch": "--batch", "micro_batches": "--micro-batches", "batches": "--batches",
             "prompt_len": "--prompt-len", "steps": "--steps", "transport": "--transport"}
    return " ".join(["tessera profile", *(f"{flag} {taken[k]}" for k, flag in flags.items() if k in taken)])


def load_profile(path: str | os.PathLike) -> StepModel:
    return profile_model(json.loads(pathlib.Path(path).read_text()))


def profile_model(data: dict) -> StepModel:
    """The profile's times as functions of b: its measurements, interpolated, and its fits."""
    samples = sorted(data.get("samples", []), key=lambda r: r["batch"])
    f = {k: Measured(tuple((r["batch"], r[f"{k}_ms"] / 1e3) for r in samples),
                     Linear(v["slope_s_per_token"], v["intercept_s"])) for k, v in data["fits"].items()}
    return StepModel(f["t_a"], f["t_e"], f["t_c"], f["t_o"], data["layers"])


def add_args(p) -> None:
    p.add_argument("--model", default=BENCH_MODEL)
    p.add_argument("--batch", type=int, default=256, help="the batch B `bench afd` will run")
    p.add_argument("--micro-batches", default="1,2,3",
                   help="the m values `bench afd` will run: each floor(B/m) (and floor(B/m) + 1) is measured")
    p.add_argument("--batches", default="8,16,32", help="further batch sizes for the linear fits")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=48, help="decode steps per batch size (as bench afd: "
                   "the same context lengths)")
    p.add_argument("--transport", default="auto", choices=["auto", "nixl", "tcp"])
    p.add_argument("--out", default="afd-profile.json")


def measure(model: str, sizes: list[int], prompt_len: int, steps: int, transport: str,
            log=lambda row: None) -> list[dict]:
    """m = 1 rows at each batch size against one expert process (pinned, one thread each)."""
    rows = []
    with expert_node(model, transport) as address:
        for batch in sizes:
            rows.append(profile_row(afd_row(model, Window(batch, prompt_len, steps), 1, address, transport)))
            log(rows[-1])
    return rows


def main(a) -> int:
    from tessera.models.loader import resolve_model_path
    resolve_model_path(a.model)
    sizes = profile_sizes(a.batch, [int(x) for x in a.micro_batches.split(",")],
                          [int(x) for x in a.batches.split(",") if x])
    rows = measure(a.model, sizes, a.prompt_len, a.steps, a.transport, lambda r: print(r, flush=True))
    profile = build_profile(rows, rows[0]["layers"])
    profile["taken"] = {"model": a.model, "prompt_len": a.prompt_len, "steps": a.steps, "transport": a.transport,
                        "batch": a.batch, "micro_batches": a.micro_batches, "batches": a.batches}
    profile["machine"] = recorded_machine()
    pathlib.Path(a.out).write_text(json.dumps(profile, indent=1))
    print(f"wrote {a.out}: " + ", ".join(f"{k} = {v['slope_s_per_token'] * 1e6:.1f} us/token + "
                                          f"{v['intercept_s'] * 1e3:.2f} ms" for k, v in profile["fits"].items()))
    return 0
