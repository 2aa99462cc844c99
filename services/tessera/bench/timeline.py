"""`tessera bench timeline FILE`: where a split request's time goes, from its spans.

Runs `tessera up FILE` with tracing at the detailed level (tracing_detail.py) exporting to a
receiver in this process (span_sink.py), sends --requests chat requests at once, drains the
deployment, and keeps one traced request's steps: an AFD decode step (attention on the
attention node, M2N sends and receives, expert work on each expert node, per micro-batch and
layer), a speculative round (drafting on the draft worker beside verification on the target), or
a pipeline step (each stage's compute and its activation transfers). All processes run on this
machine, so their span times share one clock.

The overlap fraction is measured, not modelled: the time during which both kinds of work of the
split run at once, over the shorter one's busy time (1.0: the shorter is wholly hidden behind
the other; 0.0: they take turns). Kinds: AFD afd.attention beside afd.expert; speculation
the draft worker's work (spec.draft_tree and the spec.expand forwards that grow the tree)
beside spec.verify on the target; pipeline pipeline.compute of stage 0 beside the later
stages'. The result file keeps the window's spans (their offsets in ms), from which
bench/render_plots.py draws the plot.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from tessera.bench.span_sink import SpanSink
from tessera.disagg.measure import free_port

# split kind: (the step span, the two kinds of work whose overlap is measured)
KINDS = {"afd": ("afd.step", "afd.attention", "afd.expert"),
         "spec": ("spec.round", "spec.drafting", "spec.verify"),
         "pipeline": ("pipeline.step", "pipeline.compute@0", "pipeline.compute@later")}


def add_args(p) -> None:
    p.add_argument("topology", help="a topology file with an AFD, speculative or pipeline split")
    p.add_argument("--requests", type=int, default=4, help="chat requests sent at once")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--steps", type=int, default=2, help="consecutive steps (or rounds) of one request kept")
    p.add_argument("--ready-timeout-s", type=float, default=600, help="how long the deployment may take to start")
    p.add_argument("--json", action="store_true")
    from tessera.bench.results import add_out_arg
    add_out_arg(p)


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def _chat(url: str, model: str, i: int, max_tokens: int, errors: list) -> None:
    try:
        _post_chat(url, model, i, max_tokens)
    except Exception as e:    # the run is refused below: a timeline of failed requests says nothing
        errors.append(f"request {i}: {type(e).__name__}: {e}")


def _post_chat(url: str, model: str, i: int, max_tokens: int) -> None:
    body = json.dumps({"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "messages": [{"role": "user", "content": f"Count from {i} onwards, in words."}]}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()


def record(topology: str, requests: int, max_tokens: int, ready_timeout_s: float = 600) -> list[dict]:
    """Every span the deployment exported while serving `requests` requests at once."""
    sink = SpanSink()
    port = free_port()
    # a queue that holds a run's spans: AFD makes a few hundred per step, and a full queue drops
    # spans silently, which would shorten the busy times measured
    env = dict(os.environ, OTEL_BSP_SCHEDULE_DELAY="200",
               OTEL_BSP_MAX_QUEUE_SIZE="262144", OTEL_TRACES_SAMPLER="always_on")
    log = tempfile.NamedTemporaryFile(prefix="timeline-up-", suffix=".log", delete=False)
    up = subprocess.Popen([sys.executable, "-m", "tessera.cli", "up", topology, "--port", str(port),
                           "--otlp-traces-endpoint", sink.endpoint, "--trace-level", "detailed"], env=env, start_new_session=True,
                          stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            try:
                _get(url + "/health/ready")
                break
            except OSError:
                if up.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"`tessera up {topology}` did not become ready; its log: {log.name}")
                time.sleep(1)
        model = json.loads(_get(url + "/v1/models"))["data"][0]["id"]
        errors: list[str] = []
        threads = [threading.Thread(target=_chat, args=(url, model, i, max_tokens, errors)) for i in range(requests)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise SystemExit("requests failed: " + "; ".join(errors) + f" (log: {log.name})")
        time.sleep(1.0)     # the last batches of spans (200 ms schedule)
    finally:
        _stop(up)
        sink.stop()
    return sink.spans


def _stop(up: subprocess.Popen) -> None:
    """SIGINT: a drain, in which every process flushes its spans as it exits."""
    for sig, wait_s in ((signal.SIGINT, 120), (signal.SIGKILL, 30)):
        try:
            os.killpg(up.pid, sig)
        except ProcessLookupError:    # already gone
            return
        try:
            up.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def kind_of(spans: list[dict]) -> str:
    names = {s["name"] for s in spans}
    for kind, (step, _, _) in KINDS.items():
        if step in names:
            return kind
    raise SystemExit("no step spans: is the topology split (AFD, speculative, pipeline), and did the "
                     "processes export at the detailed level?")


def window(spans: list[dict], kind: str, steps: int) -> tuple[list[dict], list[dict]]:
    """(the steps kept, every span under them in any process): the `steps` consecutive steps
    of one trace, from the middle of the request with the most of them."""
    step_name = KINDS[kind][0]
    by_trace: dict[str, list[dict]] = {}
    for s in spans:
        if s["name"] == step_name:
            by_trace.setdefault(s["trace_id"], []).append(s)
    trace = max(by_trace.values(), key=len)
    trace.sort(key=lambda s: s["start_ns"])
    mid = max(0, len(trace) // 2 - steps // 2)
    kept = trace[mid:mid + steps]
    children: dict[str, list[dict]] = {}
    for s in spans:
        children.setdefault(s["parent_span_id"], []).append(s)
    under, todo = [], [s["span_id"] for s in kept]
    while todo:
        for c in children.get(todo.pop(), []):
            under.append(c)
            todo.append(c["span_id"])
    return kept, under


def lane_of(s: dict, kind: str) -> str:
    """Which of the two measured kinds of work a span is (or its own name)."""
    if kind == "pipeline" and s["name"] == "pipeline.compute":
        return "pipeline.compute@0" if not s["stage"] else "pipeline.compute@later"
    if kind == "spec" and s["name"] in ("spec.draft_tree", "spec.expand"):
        return "spec.drafting"
    return s["name"]


def _union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals: list[tuple[int, int]]) -> int:
    return sum(b - a for a, b in intervals)


def _intersection(x: list[tuple[int, int]], y: list[tuple[int, int]]) -> int:
    total, i, j = 0, 0, 0
    while i < len(x) and j < len(y):
        total += max(0, min(x[i][1], y[j][1]) - max(x[i][0], y[j][0]))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_fraction(under: list[dict], kind: str) -> float | None:
    """Time both kinds of work run at once over the shorter one's busy time (None: one is absent)."""
    _, a_name, b_name = KINDS[kind]
    a = _union([(s["start_ns"], s["end_ns"]) for s in under if lane_of(s, kind) == a_name])
    b = _union([(s["start_ns"], s["end_ns"]) for s in under if lane_of(s, kind) == b_name])
    if not a or not b:
        return None
    return _intersection(a, b) / min(_length(a), _length(b))


def process_label(s: dict) -> str:
    role = (s["service"] or "?").removeprefix("tessera-")
    index = s["stage"] if s["stage"] is not None else s["replica"]
    return f"{role}-{index}" if index is not None else role


def summarize(spans: list[dict], steps: int) -> tuple[list[dict], dict]:
    """(rows: busy time per process and kind of work in the window, details: the overlap
    fraction and the window's spans as offsets in ms)."""
    kind = kind_of(spans)
    kept, under = window(spans, kind, steps)
    t0 = min(s["start_ns"] for s in kept)
    t1 = max(s["end_ns"] for s in kept + under)
    lanes: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for s in under:
        lanes.setdefault((process_label(s), s["name"]), []).append((s["start_ns"], s["end_ns"]))
    rows = [{"kind": kind, "process": proc, "span": name, "count": len(iv),
             "busy_ms": round(_length(_union(iv)) / 1e6, 3), "share_of_window": round(_length(_union(iv)) / (t1 - t0), 3)}
            for (proc, name), iv in sorted(lanes.items())]
    fraction = overlap_fraction(under, kind)
    keep = ("layer", "micro_batch", "stage", "tokens", "spec.accepted_tokens", "spec.draft_tokens")
    details = {"kind": kind, "steps": len(kept), "window_ms": round((t1 - t0) / 1e6, 3),
               "overlap_fraction": None if fraction is None else round(fraction, 3),
               "overlap_of": list(KINDS[kind][1:]),
               "spans": [{"process": process_label(s), "name": s["name"], "start_ms": round((s["start_ns"] - t0) / 1e6, 3),
                          "end_ms": round((s["end_ns"] - t0) / 1e6, 3),
                          **{k: s["attributes"][f"tessera.{k}"] for k in keep if f"tessera.{k}" in s["attributes"]}}
                         for s in sorted(kept + under, key=lambda s: s["start_ns"])]}
    return rows, details


def main(a) -> int:
    from tessera.bench import results
    spans = record(a.topology, a.requests, a.max_tokens, a.ready_timeout_s)
    rows, details = summarize(spans, a.steps)
    if a.json:
        print(json.dumps({"rows": rows, **{k: v for k, v in details.items() if k != "spans"}}))
    else:
        for r in rows:
            print(f"{r['process']:>18} {r['span']:<18} x{r['count']:<4} {r['busy_ms']:9.3f} ms "
                  f"({100 * r['share_of_window']:.0f} % of the window)")
        print(f"{details['kind']}: {details['steps']} steps, {details['window_ms']} ms; overlap of "
              f"{' and '.join(details['overlap_of'])}: {details['overlap_fraction']}")
    if a.out:
        title = f"Timeline of {details['kind']} steps from their spans ({a.topology}, {a.requests} requests at once)"
        results.write(a.out, results.document("timeline", title, rows, details=details))
    return 0
