"""`tessera bench timeline`'s measures from spans: the overlap fraction against a brute force on
a grid, and the window of steps with every span under them, whatever process recorded it."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

import servers
from tessera.bench import timeline as tl

MS = 1_000_000     # the synthetic spans' times are in ms


def brute_overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> float | None:
    if not a or not b:
        return None
    busy_a = {t for x, y in a for t in range(x, y)}
    busy_b = {t for x, y in b for t in range(x, y)}
    return len(busy_a & busy_b) / min(len(busy_a), len(busy_b))


def span(name: str, start: int, end: int, parent: str = "", span_id: str | None = None, trace: str = "t",
         service: str = "tessera-attention-node", stage=None, replica=None, **attributes) -> dict:
    return {"trace_id": trace, "span_id": span_id or f"{name}-{start}-{random.random()}", "parent_span_id": parent,
            "name": name, "service": service, "instance": "h:1", "replica": replica, "stage": stage,
            "start_ns": start * MS, "end_ns": end * MS, "attributes": {f"tessera.{k}": v for k, v in attributes.items()},
            "links": []}


@pytest.mark.parametrize("seed", range(40))
def test_the_overlap_fraction_is_the_brute_forces(seed):
    rng = random.Random(seed)

    def intervals():
        out = []
        for _ in range(rng.randrange(0, 6)):
            x = rng.randrange(0, 60)
            out.append((x, x + rng.randrange(1, 15)))
        return out
    a, b = intervals(), intervals()
    under = [span("afd.attention", x, y) for x, y in a] + [span("afd.expert", x, y, service="tessera-expert-node")
                                                           for x, y in b]
    got = tl.overlap_fraction(under, "afd")
    want = brute_overlap(a, b)
    assert got == pytest.approx(want) if want is not None else got is None


def test_the_window_keeps_middle_steps_of_the_longest_trace_and_all_spans_under_them():
    spans = []
    for i in range(6):        # trace "t": six steps, each with attention here and expert work elsewhere
        step = span("afd.step", 100 * i, 100 * i + 90, span_id=f"s{i}")
        send = span("m2n.send", 100 * i + 10, 100 * i + 20, parent=f"s{i}", span_id=f"send{i}", micro_batch=0)
        expert = span("afd.expert", 100 * i + 20, 100 * i + 60, parent=f"send{i}", service="tessera-expert-node",
                      replica=1, micro_batch=0)
        attention = span("afd.attention", 100 * i, 100 * i + 40, parent=f"s{i}", micro_batch=1)
        spans += [step, send, expert, attention]
    spans.append(span("afd.step", 0, 50, span_id="other", trace="u"))        # a shorter trace
    spans.append(span("afd.attention", 0, 10, parent="other", trace="u"))
    kept, under = tl.window(spans, "afd", 2)
    assert [s["span_id"] for s in kept] == ["s2", "s3"]
    assert sorted(s["name"] for s in under) == sorted(["m2n.send", "afd.expert", "afd.attention"] * 2)
    rows, details = tl.summarize(spans, 2)
    assert details["kind"] == "afd" and details["steps"] == 2 and details["window_ms"] == 190
    # attention [0, 40) and expert [20, 60) in each step: 20 of the shorter 40 at once
    assert details["overlap_fraction"] == 0.5
    expert = [r for r in rows if r["span"] == "afd.expert"]
    assert [(r["process"], r["count"]) for r in expert] == [("expert-node-1", 2)]
    assert details["spans"][0]["start_ms"] == 0 and {s["process"] for s in details["spans"]} == \
        {"attention-node", "expert-node-1"}


def test_a_pipeline_splits_stage_zero_from_the_later_stages():
    spans = [span("pipeline.step", 0, 100, span_id="p", service="tessera-pipeline-shard", stage=0),
             span("pipeline.compute", 0, 50, parent="p", service="tessera-pipeline-shard", stage=0),
             span("pipeline.compute", 40, 90, parent="p", service="tessera-pipeline-shard", stage=1)]
    _, details = tl.summarize(spans, 1)
    assert details["kind"] == "pipeline" and details["overlap_fraction"] == round(10 / 50, 3)


def test_speculation_counts_the_draft_workers_tree_and_expansions_as_drafting():
    spans = [span("spec.round", 0, 100, span_id="r", service="tessera-target-worker"),
             span("spec.draft", 0, 10, parent="r", span_id="d", service="tessera-target-worker"),
             span("spec.draft_tree", 2, 8, parent="d", span_id="t", service="tessera-draft-worker"),
             span("spec.expand", 12, 42, parent="t", service="tessera-draft-worker"),
             span("spec.verify", 10, 100, parent="r", service="tessera-target-worker")]
    _, details = tl.summarize(spans, 1)
    assert details["kind"] == "spec" and details["overlap_fraction"] == round(30 / 36, 3)


def test_spans_without_steps_are_refused_with_a_reason():
    with pytest.raises(SystemExit, match="detailed level"):
        tl.summarize([span("worker.generate", 0, 10)], 1)


@pytest.mark.e2e
def test_the_command_draws_a_pipeline_from_tessera_up(tiny_models, tmp_path):
    """`tessera bench timeline` on the shipped pipeline topology (a tiny model, free ports):
    every stage's spans in the window, and an overlap fraction measured from them."""
    path = servers.tiny_topology("pipeline-pq", tiny_models, tmp_path)
    out = tmp_path / "timeline.json"
    run = subprocess.run([sys.executable, "-m", "tessera.cli", "bench", "timeline", str(path), "--requests", "2",
                          "--max-tokens", "8", "--ready-timeout-s", "200", "--json", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    printed = json.loads(run.stdout.strip().splitlines()[-1])
    assert printed["kind"] == "pipeline" and 0.0 <= printed["overlap_fraction"] <= 1.0
    assert {(r["process"], r["span"]) for r in printed["rows"]} >= {("pipeline-shard-0", "pipeline.compute"),
                                                                    ("pipeline-shard-1", "pipeline.compute")}
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "timeline" and doc["details"]["spans"][0]["start_ms"] == 0
