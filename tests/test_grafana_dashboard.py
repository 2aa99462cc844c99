"""deploy/grafana/tessera.json queries only metrics the processes really expose: a `tessera
worker` with --metrics-port and a `tessera gateway` in front of it are started, one completion
goes through (so the histograms have samples), and every metric name in every panel's PromQL is
looked up in the two live /metrics pages. (`tessera serve` starts its worker without a metrics
port, so the worker and gateway are started here as a deployment starts them.)"""
from __future__ import annotations

import json
import pathlib
import re

import httpx
import pytest

from servers import free_port, tessera_gateway, tessera_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DASHBOARD = pathlib.Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "tessera.json"
# PromQL words that look like names: keywords, aggregation modifiers, set operators
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
            "offset", "inf", "nan"}
SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}


def expressions(dashboard: dict) -> list[str]:
    """Every panel target's PromQL, and the metric of each label_values(...) variable."""
    found = []
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        query = query.get("query", "") if isinstance(query, dict) else str(query or "")
        found += re.findall(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)", query)

    def walk(panels):
        for p in panels:
            found.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            walk(p.get("panels", []))
    walk(dashboard["panels"])
    return found


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers left once strings, label
    matchers, range and grouping clauses are removed, that are not functions or keywords."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        followed = text[m.end():].lstrip()
        if not followed.startswith("(") and m.group() not in KEYWORDS:
            names.add(m.group())
    return names


def exposed(page: str) -> dict[str, str]:
    """Sample name -> type of its family, from Prometheus text: a histogram `x` exposes x_bucket,
    x_sum and x_count, never x itself; a counter's TYPE line already names x_total."""
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", page, re.M))
    samples = {}
    for family, kind in types.items():
        for suffix in SUFFIXES.get(kind, ("",)):
            samples[family + suffix] = kind
    return samples


def test_metric_names_parse():
    expr = ('histogram_quantile(0.9, sum by (le) (rate(a_seconds_bucket{model_name=~"$m",x="by(y)"}'
            '[$__rate_interval]))) / sum without (instance) (b_total) + on (job) group_left c')
    assert metric_names(expr) == {"a_seconds_bucket", "b_total", "c"}
    page = "# TYPE h histogram\nh_bucket{le=\"1\"} 0\n# TYPE c_total counter\n# TYPE g gauge\n"
    assert exposed(page) == {"h_bucket": "histogram", "h_sum": "histogram", "h_count": "histogram",
                             "c_total": "counter", "g": "gauge"}


def test_every_panel_metric_is_exposed():
    dashboard = json.loads(DASHBOARD.read_text())
    assert {v["name"] for v in dashboard["templating"]["list"]} >= {"datasource"}
    used = set().union(*map(metric_names, expressions(dashboard)))
    assert used, "the dashboard has no PromQL"
    metrics_port = free_port()
    worker_args = ("--model", "random:llama", "--dtype", "float32", "--threads", "1", "--graph-warmup-s", "0",
                   "--num-kv-blocks", "64", "--metrics-port", str(metrics_port))
    with tessera_grpc("worker", *worker_args, timeout_s=60) as (address, _), \
            tessera_gateway("--worker", address, timeout_s=60) as (url, _):
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        reply = httpx.post(url + "/v1/completions", timeout=60,
                           json={"model": model, "prompt": "hello", "max_tokens": 4, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        gateway = httpx.get(url + "/metrics").text
        worker = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
    samples = {**exposed(gateway), **exposed(worker)}
    missing = sorted(used - samples.keys())
    assert not missing, f"panel expressions use metrics no process exposes: {missing}"
    # the completion reached the histograms the latency panels read
    for name in ("tessera_time_to_first_token_seconds", "tessera_e2e_request_latency_seconds",
                 "tessera_inter_token_latency_seconds", "tessera_request_prefill_time_seconds"):
        assert re.search(rf"^{name}_count{{[^}}]*}} [1-9]", gateway, re.M), f"{name} has no sample"
