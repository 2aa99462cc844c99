"""`tessera bench spec`: batch-1 greedy decode speed, plain against serial and disaggregated tree
speculation (SwiftSpec's ablation; docs/design/speculative.md), on the kinds in bench/prompts/.

Measured, on two cores: plain and serial (draft, then verify) with 2 threads on both cores;
disaggregated with the target here on core 0 and the draft on core 1, 1 thread each (a `tessera
draft-worker` process, or an AsyncProposer thread here: "draft_location"). Decode speeds (TTFT
excluded), the median of --repeats runs; every mode's tokens are checked against plain greedy
("identical"; a mismatch is printed and the exit status is 1). Simulated (spec/simulator.py),
and labelled so: predicted_tok_s from a profile measured here first, at each kind's own prompt,
with the row's measured tokens per round and hit rate; the paper's ablation from its numbers.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import statistics
import sys
import threading
from dataclasses import dataclass
from typing import Any

from tessera.spec.profile import (Run, lookup_round_s, measure_draft, measure_target, placed, profile_ms,
                                  timed_generate, two_cores, warm_thread_pool)
from tessera.spec.simulator import (Rounds, Shape, SpecProfile, depth_candidates, latency_bound_size,
                                    paper_projection, tok_s)

PROMPTS = pathlib.Path(__file__).parent / "prompts"
KINDS = ("chat", "summarisation", "code")


def add_args(p) -> None:
    p.add_argument("--model", default="smollm2", help="target model (default: SmolLM2-135M)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--drafter", action="append", default=None,
                   help="repeatable: 'self:K', 'ngram' or a draft model (default: self:8)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"prompt kinds from bench/prompts ({', '.join(KINDS)})")
    p.add_argument("--modes", default="plain,serial,disaggregated")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="runs per row (the median is reported)")
    p.add_argument("--profile-steps", type=int, default=8, help="timed steps per profiled size")
    p.add_argument("--spec-tree-size", type=int, default=8, help="bs: nodes verified per round")
    p.add_argument("--spec-width", type=int, default=4, help="w: leaves per draft expansion")
    p.add_argument("--spec-depth", type=int, default=3, help="d: draft expansions per round")
    p.add_argument("--draft-location", default="auto", choices=["auto", "process", "thread"],
                   help="disaggregated draft: a draft-worker process, a thread here, or process when it exists")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", metavar="FILE", help="also write a result file (tessera.bench.results)")


@dataclass
class Bench:
    """What every run shares: the target's weights, tokenizer, placement and settings."""
    a: argparse.Namespace
    model: Any                      # the target CausalLM (a self:K draft shares its weights)
    tokenizer: Any
    shape: Shape
    cores: tuple[int, int]
    max_len: int

    @property
    def both(self) -> tuple[set[int], int]:
        return set(self.cores), 2

    def spec(self, drafter: str | None, address: str | None = None):
        from tessera.config import SpeculativeConfig
        return SpeculativeConfig(draft=drafter, draft_address=address, tree_size=self.shape.bs,
                                 width=self.shape.w, depth=self.shape.d)

    def engine(self, drafter: str | None = None, proposer=None, address: str | None = None):
        from tessera.config import CacheConfig, EngineConfig
        from tessera.engine import Engine
        blocks = 2 * (self.max_len // 16 + 2)
        config = EngineConfig(model=self.a.model, dtype=self.a.dtype, max_model_len=self.max_len,
                              cache=CacheConfig(num_blocks=blocks), speculative=self.spec(drafter, address))
        return Engine(config, model=self.model, tokenizer=self.tokenizer, proposer=proposer)


def load_prompt(kind: str, tokenizer) -> list[int]:
    from tessera.tokenizer import user_message_ids
    return user_message_ids(tokenizer, (PROMPTS / f"{kind}.txt").read_text())


def repeated(engine, prompt: list[int], n: int, max_tokens: int,
             hits=lambda: None) -> tuple[Run, tuple[float, float] | None, bool]:
    """(the median-speed run, its (hit rate, top-ups per round), whether every run emitted the
    same tokens). hits() -> (rounds, hits, top-ups) counters of the proposer, or None."""
    timed_generate(engine, prompt[:8], 2)                            # warm-up
    runs = []
    for _ in range(n):
        before = hits()
        run = timed_generate(engine, prompt, max_tokens)
        after = hits()
        rounds = None if before is None or after is None else max(after[0] - before[0] - 1, 1)
        rate = None if rounds is None else \
            ((after[1] - before[1]) / rounds, (after[2] - before[2]) / rounds)   # the first round starts a tree
        runs.append((run, rate))
    runs.sort(key=lambda r: r[0].tok_s)
    run, rate = runs[len(runs) // 2]
    return run, rate, all(r.tokens == run.tokens for r, _ in runs)


def proposer_hits(proposer):
    """() -> (rounds, hits, top-ups) of an in-process proposer's DraftStats."""
    return lambda: (proposer.stats.rounds, proposer.stats.hits, proposer.stats.topups)


METRICS = ("tessera_draft_worker_rounds_total", "tessera_draft_worker_tree_hits_total",
           "tessera_draft_worker_topup_expansions_total")


def metrics_hits(url: str):
    """() -> (rounds, hits, top-ups) from a draft worker's /metrics, or None when it does not say."""
    import logging
    logging.getLogger("httpx").setLevel(logging.WARNING)      # one scrape per run, not worth a log line

    def read():
        import httpx
        try:
            text = httpx.get(url, timeout=5).text
        except httpx.HTTPError:
            return None
        values = {}
        for line in text.splitlines():
            name, _, rest = line.partition("{")
            if name in METRICS:
                values[name] = float(rest.rsplit(" ", 1)[-1])
        return tuple(values[m] for m in METRICS) if len(values) == len(METRICS) else None
    return read


def draft_worker_exists() -> bool:
    from tessera.cli import COMMANDS
    return ("draft-worker",) in COMMANDS


@contextlib.contextmanager
def draft_worker(b: Bench, drafter: str):
    """A `tessera draft-worker` on core 1 with one thread; yields (address, t_comm, hits): t_comm
    is the median loopback gRPC health round trip, standing in for one round's messages."""
    import subprocess
    import time

    from tessera.disagg.measure import free_port, stop_process
    port, metrics = free_port(), free_port()
    argv = [sys.executable, "-m", "tessera.cli", "draft-worker", "--model", b.a.model, "--dtype", b.a.dtype,
            "--speculative", drafter, "--spec-tree-size", str(b.shape.bs), "--spec-width", str(b.shape.w),
            "--spec-depth", str(b.shape.d), "--max-model-len", str(b.max_len), "--threads", "1",
            "--cpu", str(b.cores[1]), "--port", str(port), "--metrics-port", str(metrics)]
    proc = subprocess.Popen(argv, stdout=sys.stderr)     # stdout carries only the bench's --json
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while not _healthy(address):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"draft worker did not start: {' '.join(argv)} (exit {proc.poll()})")
            time.sleep(0.5)
        samples = []
        for _ in range(20):
            t0 = time.perf_counter()
            _healthy(address)
            samples.append(time.perf_counter() - t0)
        yield address, statistics.median(samples), metrics_hits(f"http://127.0.0.1:{metrics}/metrics")
    finally:
        stop_process(proc)


def _healthy(address: str) -> bool:
    from tessera.entrypoints.probe import main as probe
    return probe(address, timeout_s=2.0) == 0


@contextlib.contextmanager
def disaggregated_engine(b: Bench, drafter: str, location: str):
    """Yields (engine, where the draft runs, t_comm, hits) with this thread on core 0, one thread."""
    import os

    from tessera.spec.draft_models import draft_model
    from tessera.spec.proposer import AsyncProposer
    with placed({b.cores[0]}, 1):
        if location == "process":
            with draft_worker(b, drafter) as (address, t_comm, hits):
                yield b.engine(drafter, address=address), "process", t_comm, hits
            return
        model, layers = draft_model(drafter, b.model, b.model.embed_tokens.weight.dtype)
        proposer = AsyncProposer(model, layers, b.spec(drafter), b.max_len)
        expander = next(t for t in threading.enumerate() if t.name == "draft-expand" and t.is_alive())
        assert expander.native_id is not None
        os.sched_setaffinity(expander.native_id, {b.cores[1]})   # it was started on core 0, like us
        try:
            yield b.engine(drafter, proposer=proposer), "thread", 0.0, proposer_hits(proposer)
        finally:
            proposer.close()


def draft_location(a) -> str:
    if a.draft_location != "auto":
        if a.draft_location == "process" and not draft_worker_exists():
            raise SystemExit("bench spec: --draft-location process needs `tessera draft-worker`, which does not exist yet")
        return a.draft_location
    if draft_worker_exists():
        return "process"
    print("bench spec: `tessera draft-worker` does not exist yet: the disaggregated draft runs as a thread "
          "pinned to core 1 in this process (draft_location: thread)", file=sys.stderr)
    return "thread"


MODEL_FREE = ("ngram",)     # drafters that run no model: nothing to expand, nothing to overlap


def shape_for(b: Bench, drafter: str) -> Shape:
    """The shape the simulator sees: a model-free drafter makes no expansions (d = 0)."""
    return Shape(b.shape.bs, b.shape.w, 0) if drafter in MODEL_FREE else b.shape


def profiles(b: Bench, drafter: str, prompt: list[int], targets: dict) -> dict[str, SpecProfile]:
    """Per mode: serial on both cores (2 threads); disaggregated with the target on core 0 and the
    draft on core 1 (1 thread each), measured one at a time; plain uses serial's t_target(1).
    A model-free drafter's round is its lookup (t_round), serial only."""
    steps = b.a.profile_steps
    if drafter in MODEL_FREE:
        with placed(*b.both):
            return {"serial": SpecProfile({1: 0.0}, targets["both"], t_round=lookup_round_s(prompt, b.shape.bs, steps))}
    from tessera.spec.draft_models import draft_model
    model, layers = draft_model(drafter, b.model, b.model.embed_tokens.weight.dtype)
    out = {}
    for mode, place, t_target in (("serial", b.both, targets["both"]),
                                  ("disaggregated", ({b.cores[1]}, 1), targets["core0"])):
        t_draft, t_round, t_flush = measure_draft(model, layers, prompt, b.shape, steps, place)
        out[mode] = SpecProfile(t_draft, t_target, t_flush, t_round)
    return out


def row(mode: str, drafter: str | None, kind: str, run: Run, reference: list[int] | None, same: bool,
        predicted: float, **extra) -> dict:
    identical = same and (reference is None or run.tokens == reference)
    if not identical:
        where = next((i for i, (x, y) in enumerate(zip(run.tokens, reference or run.tokens)) if x != y), None)
        print(f"bench spec: MISMATCH: {mode} {drafter} {kind}: tokens differ from plain greedy "
              f"(first at position {where}; repeats identical: {same})", file=sys.stderr)
    return {"mode": mode, "drafter": drafter, "kind": kind, "output_tok_s": round(run.tok_s, 2),
            "acceptance_length": round(run.acceptance_length, 3), "tpot_ms": round(run.tpot_ms, 2),
            "predicted_tok_s": round(predicted, 2), "prediction_error": round(predicted / run.tok_s - 1, 3),
            "simulated": "predicted_tok_s", "identical": identical, "output_tokens": len(run.tokens), **extra}


def plain_rows(b: Bench, prompts: dict[str, list[int]], by_kind: dict[str, SpecProfile]) -> tuple[list[dict], dict]:
    rows, reference = [], {}
    with placed(*b.both):
        engine = b.engine()
        for kind, prompt in prompts.items():
            run, _, same = repeated(engine, prompt, b.a.repeats, b.a.max_tokens)
            reference[kind] = run.tokens
            rows.append(row("plain", None, kind, run, None, same, tok_s("plain", by_kind[kind], b.shape, Rounds()),
                            threads=2))
    return rows, reference


def serial_rows(b: Bench, drafter: str, prompts: dict, reference: dict, profs: dict) -> list[dict]:
    with placed(*b.both):
        engine = b.engine(drafter)
        return [_spec_row("serial", b, drafter, kind, engine, prompt, reference, profs,
                          proposer_hits(engine.proposer), threads=2) for kind, prompt in prompts.items()]


def disaggregated_rows(b: Bench, drafter: str, prompts: dict, reference: dict, profs: dict,
                       location: str) -> list[dict]:
    """Every kind's profs[kind]["disaggregated"] gets the measured t_comm (the caller reports it)."""
    if drafter in MODEL_FREE:
        return [{"mode": "disaggregated", "drafter": drafter, "kind": None,
                 "skipped": "a model-free drafter has no draft forward to overlap with verification"}]
    with disaggregated_engine(b, drafter, location) as (engine, where, t_comm, hits):
        for by_mode in profs.values():
            by_mode["disaggregated"] = _with_comm(by_mode["disaggregated"], t_comm)
        return [_spec_row("disaggregated", b, drafter, kind, engine, prompt, reference, profs, hits,
                          threads=1, draft_location=where) for kind, prompt in prompts.items()]


def drafter_rows(b: Bench, drafter: str, prompts: dict, reference: dict, targets: dict,
                 location: str, report: dict) -> list[dict]:
    """Serial and disaggregated rows of one drafter; one that fails becomes an error row."""
    modes = [m for m in ("serial", "disaggregated") if m in b.a.modes.split(",")]
    try:
        profs = {kind: profiles(b, drafter, prompt, targets[kind]) for kind, prompt in prompts.items()}
    except Exception as e:          # a drafter this build cannot make (e.g. an unknown name): say so
        return [_error_row(mode, drafter, e) for mode in modes]
    rows = []
    for mode in modes:
        try:
            rows += serial_rows(b, drafter, prompts, reference, profs) if mode == "serial" else \
                disaggregated_rows(b, drafter, prompts, reference, profs, location)
        except Exception as e:
            rows.append(_error_row(mode, drafter, e))
    report["profile"][drafter] = {kind: {mode: profile_ms(p) for mode, p in by_mode.items()}
                                  for kind, by_mode in profs.items()}
    report["recommended"][drafter] = recommendations(b, next(iter(profs.values())))
    return rows


def _error_row(mode: str, drafter: str, e: Exception) -> dict:
    print(f"bench spec: {mode} with drafter {drafter}: {type(e).__name__}: {e}", file=sys.stderr)
    return {"mode": mode, "drafter": drafter, "error": f"{type(e).__name__}: {e}"}


def _with_comm(p: SpecProfile, t_comm: float) -> SpecProfile:
    return SpecProfile(p.t_draft, p.t_target, p.t_prefix_flush, p.t_round, t_comm)


def _spec_row(mode, b: Bench, drafter, kind, engine, prompt, reference, profs, hits, **extra) -> dict:
    """hits() -> (rounds, hits) counters of the mode's proposer (None: unknown, taken as 0)."""
    run, rates, same = repeated(engine, prompt, b.a.repeats, b.a.max_tokens, hits)
    hit_rate, topups = rates if rates is not None else (None, None)
    rounds = Rounds.of(run.per_round, hit_rate if hit_rate is not None else 0.0, topups, run.nodes)
    predicted = tok_s(mode, profs[kind][mode], shape_for(b, drafter), rounds)
    return row(mode, drafter, kind, run, reference.get(kind), same, predicted,
               hit_rate=None if hit_rate is None else round(hit_rate, 3),
               topups_per_round=None if topups is None else round(topups, 3),
               emitted_per_round={k: v for k, v in sorted(rounds.emitted.items())}, **extra)


def async_vs_serial(rows: list[dict]) -> list[dict]:
    """Acceptance length of the asynchronous tree against the serial one (the paper: -9 % on average)."""
    by = {(r["mode"], r["drafter"], r["kind"]): r for r in rows if "acceptance_length" in r}
    out = []
    for (mode, drafter, kind), r in by.items():
        serial = by.get(("serial", drafter, kind))
        if mode == "disaggregated" and serial and serial["acceptance_length"]:
            out.append({"drafter": drafter, "kind": kind, "serial": serial["acceptance_length"],
                        "disaggregated": r["acceptance_length"],
                        "ratio": round(r["acceptance_length"] / serial["acceptance_length"], 3)})
    return out


def recommendations(b: Bench, profs: dict[str, SpecProfile]) -> dict:
    """The paper's d rule on the disaggregated profile, and the latency-bound bs and w per mode."""
    tries = {"disaggregated_d_try": list(depth_candidates(profs["disaggregated"], b.shape.bs, b.shape.w))} \
        if "disaggregated" in profs else {}
    return {**tries, "configured": vars(b.shape),
            **{f"{mode}_latency_bound": {"bs": latency_bound_size(p.t_target), "w": latency_bound_size(p.t_draft)}
               for mode, p in profs.items()}}


def setup(a) -> tuple[Bench, dict[str, list[int]]]:
    import torch

    from tessera.models.loader import load_model
    from tessera.tokenizer import load_tokenizer
    warm_thread_pool(2)
    model, _ = load_model(a.model, getattr(torch, a.dtype))
    tokenizer = load_tokenizer(a.model)
    prompts = {k: load_prompt(k, tokenizer) for k in a.kinds.split(",") if k}
    shape = Shape(a.spec_tree_size, a.spec_width, a.spec_depth)
    max_len = max(map(len, prompts.values())) + a.max_tokens + shape.bs + 16
    return Bench(a, model, tokenizer, shape, two_cores(), max_len), prompts


def main(a) -> int:
    if a.max_tokens < 2 or a.repeats < 1:
        raise SystemExit("bench spec: --max-tokens must be >= 2 and --repeats >= 1")
    b, prompts = setup(a)
    modes = a.modes.split(",")
    location = draft_location(a) if "disaggregated" in modes else "none"
    # every kind profiled at its own prompt: a longer context costs the target and the draft more
    targets = {kind: {name: measure_target(lambda p: b.engine(proposer=p), prompt, b.shape.bs, a.profile_steps, place)
                      for name, place in (("both", b.both), ("core0", ({b.cores[0]}, 1)))}
               for kind, prompt in prompts.items()}
    plain = {kind: SpecProfile(t_draft={}, t_target=t["both"]) for kind, t in targets.items()}
    rows, reference = plain_rows(b, prompts, plain) if "plain" in modes else ([], {})
    report: dict[str, Any] = {"rows": rows, "profile": {}, "recommended": {}, "measured_on": {
        "model": a.model, "dtype": a.dtype, "cores": list(b.cores), "max_tokens": a.max_tokens,
        "repeats": a.repeats, "draft_location": location, "shape": vars(b.shape)}}
    for drafter in a.drafter or ["self:8"]:
        rows += drafter_rows(b, drafter, prompts, reference, targets, location, report)
    report["async_vs_serial_acceptance"] = async_vs_serial(rows)
    report["paper_projection_simulated"] = paper_projection()
    print(json.dumps(report, indent=1) if a.json else _text(report))
    if a.out:
        from tessera.bench import results, rows as schema
        results.write(a.out, schema.spec(a, report))
    return 0 if all(r.get("identical", True) and "error" not in r for r in rows) else 1


def _text(report: dict) -> str:
    lines = ["mode           drafter  kind            tok/s  pred   err     acc.len  tpot ms  identical"]
    for r in report["rows"]:
        if "acceptance_length" not in r:
            lines.append(f"{r['mode']:<14} {r['drafter']:<8} {r.get('error') or 'skipped: ' + r['skipped']}")
            continue
        lines.append(f"{r['mode']:<14} {r['drafter'] or '-':<8} {r['kind']:<14} {r['output_tok_s']:>7} "
                     f"{r['predicted_tok_s']:>6} {r['prediction_error']:>+6.1%} {r['acceptance_length']:>8} "
                     f"{r['tpot_ms']:>8}  {r['identical']}")
    lines.append("(pred: SIMULATED from the profile below and the row's measured tokens per round)")
    lines.append("profile (measured here): " + json.dumps(report["profile"]))
    lines.append("async vs serial acceptance: " + json.dumps(report["async_vs_serial_acceptance"]))
    p = report["paper_projection_simulated"]
    lines.append(f"SIMULATED paper projection ({p['source']}): serial {p['serial']['predicted_tok_s']} "
                 f"(paper 200), disaggregated {p['disaggregated']['predicted_tok_s']} (paper 274), "
                 f"speed-up {p['speedup']} (paper {p['paper_speedup']}), assumed miss rate {p['assumed']['miss_rate']}")
    return "\n".join(lines)
