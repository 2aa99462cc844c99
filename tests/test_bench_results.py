"""The benchmark result files and the pages made from them: every file in bench/results/ follows
the schema bench/render.py reads, and rendering them again reproduces the committed
docs/benchmarks/*.md byte for byte (the pages are regenerated, never edited by hand)."""
from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PAGES = ROOT / "docs" / "benchmarks"


@pytest.fixture(scope="module")
def render():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location("bench_render", ROOT / "bench" / "render.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(ROOT / "bench"))


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_every_result_file_follows_the_schema(render, path):
    doc = json.loads(path.read_text())
    assert render.problems(doc) == []
    assert doc["command"].strip() and doc["rows"]
    assert path.stem.startswith(doc["benchmark"].split("-")[0] + "-"), "file name: <benchmark>-<kind>-<date>..."


def test_the_schema_check_names_what_is_missing(render):
    good = {"schema": 1, "benchmark": "served", "title": "t", "date": "2026-12-06", "command": "not recorded",
            "machine": {"cpu": "AMD EPYC Zen 5", "kind": "zen5", "flags": ["avx2"], "cores": 2},
            "versions": {}, "simulated": False, "rows": [{"output_tok_s": 1.0}]}
    assert render.problems(good) == []
    bad = {**good, "date": "yesterday", "rows": [], "machine": {"cpu": "x", "kind": "m1", "flags": []}}
    assert set(render.problems(bad)) == {"date: not YYYY-MM-DD or an ISO timestamp", "rows: empty, or not all objects",
                                        "machine.cores: missing or not int",
                                        "machine.kind: 'm1' is none of " + ", ".join(render.KINDS)}


def test_the_committed_pages_are_what_render_writes(render, tmp_path):
    texts = render.render(RESULTS, tmp_path, plots=False)
    committed = {p.name: p.read_text() for p in PAGES.glob("*.md")}
    assert sorted(texts) == sorted(committed), "run .venv/bin/python bench/render.py"
    for name, text in texts.items():
        assert text == committed[name], f"docs/benchmarks/{name} differs: run .venv/bin/python bench/render.py"
    images = {line.split("](img/", 1)[1].split(")", 1)[0] for text in texts.values() for line in text.splitlines()
              if "](img/" in line}
    assert images and all((PAGES / "img" / name).is_file() for name in images)


def test_a_served_run_becomes_a_result_file_with_its_samples(render, tmp_path):
    """What `tessera bench serve --out` writes (tessera.bench.rows) is a file the pages render,
    its per-request TTFT and TPOT plotted; a second run of the same benchmark adds its row."""
    from tessera.bench import results, rows
    run = {"num_prompts": 2, "concurrency": None, "input_len": 8, "output_len": 4, "output_tok_s": 10.0,
           "ttft_ms": {"mean": 5.0, "p50": 5.0, "p99": 6.0}, "tpot_ms": {"mean": 1.0, "p50": 1.0, "p99": 1.2},
           "itl_ms": {"mean": 1.0, "p50": 1.0, "p99": 1.2}, "e2e_ms": {"mean": 9.0, "p50": 9.0, "p99": 9.5},
           "model": "m", "endpoint": "completions", "range_ratio": 0.0, "shared_prefix_len": 0, "request_rate": None,
           "completed": 2, "failed": 0, "duration_s": 0.8, "cached_prompt_tokens": 0, "server_ms": None,
           "ttft_outside_engine_ms": None, "machine": None, "owned_by": "tessera",
           "samples": {"ttft_ms": [5.0, 6.0], "tpot_ms": [1.0, 1.2]}}
    a = argparse.Namespace(server=None, server_dtype="bfloat16", server_quantization=None)
    out = tmp_path / "results" / "served-test.json"
    doc = rows.served(a, run)
    doc["machine"]["mem_bandwidth_gbs"] = None
    results.write(out, doc)
    results.write(out, {**doc, "rows": [{**doc["rows"][0], "concurrency": 1}]})
    written = json.loads(out.read_text())
    assert render.problems(written) == [] and len(written["rows"]) == 2
    assert written["rows"][0]["server"] == "tessera" and written["rows"][0]["samples"]["ttft_ms"] == [5.0, 6.0]
    texts = render.render(out.parent, tmp_path / "pages", plots=False)
    assert "img/served-test-ttft-tpot.png" in texts["served.md"]


def test_the_machine_is_described(render):
    from tessera.bench import machine
    m = machine.machine(bandwidth=False)
    assert m["kind"] in render.KINDS and m["cores"] >= 1 and set(m["flags"]) <= set(machine.FLAGS)
    assert machine.cpu_kind("AuthenticAMD", 25, 17, set()) == "zen4"
    assert machine.cpu_kind("AuthenticAMD", 25, 1, set()) == "zen3"
    assert machine.cpu_kind("AuthenticAMD", 26, 2, set()) == "zen5"
    assert machine.cpu_kind("AuthenticAMD", 23, 1, set()) == "zen1"
    assert machine.cpu_kind("AuthenticAMD", 23, 49, set()) == "zen2"
    assert machine.cpu_kind("GenuineIntel", 6, 167, {"amx_tile", "avx512f"}) == "xeon-amx"
    assert machine.cpu_kind("GenuineIntel", 6, 207, {"avx512f", "avx512_bf16"}) == "xeon-amx-hidden"
    assert machine.cpu_kind("GenuineIntel", 6, 85, {"avx512f"}) == "xeon-avx512"
    assert machine.command_line(["/x/.venv/bin/tessera", "bench", "serve"]) == "tessera bench serve"
    assert machine.command_line(["bench/tls_cost.py", "3"]) == "python bench/tls_cost.py 3"


def test_every_benchmark_s_rows_become_a_result_file(render, monkeypatch):
    """tessera.bench.rows turns each command's own output into schema rows (synthetic outputs
    here, with the keys each command prints)."""
    from tessera.bench import machine, rows
    monkeypatch.setattr(machine, "mem_bandwidth_gbs", lambda *a, **k: None)
    a = argparse.Namespace(model="m", batch=4, input_len=8, output_len=4, dtype="float32", max_tokens=8,
                           prompt_len=8, gen_len=4)
    mono = {"mode": "monolithic", "batch": 4, "output_tokens": 8, "output_tok_s": 10.0, "iteration_ms": 1.0}
    afd = [{"mode": "afd", "micro_batches": m, "batch": 4, "output_tok_s": 8.0 + m, "iteration_ms": 2.0,
            "projection_simulated": [{"attention_nodes": 2, "expert_nodes": 1, "expert": "aggregated",
                                      "iteration_ms": 1.5, "output_tok_s": 20.0, "tok_s_per_core": 6.7}]}
           for m in (1, 2)]
    spec = {"rows": [{"mode": "plain", "drafter": None, "kind": "code", "output_tok_s": 10.0},
                     {"mode": "serial", "drafter": "ngram", "kind": "code", "output_tok_s": 15.0,
                      "acceptance_length": 1.5, "predicted_tok_s": 14.0, "identical": True},
                     {"mode": "disaggregated", "drafter": "ngram", "kind": None, "skipped": "model-free"}],
            "profile": {}, "measured_on": {}}
    pq = {"rows": [{"plan": "llm-pq", "stages": 2, "layout": "dev-a[0:16) 16x16 | dev-b[16:30) 16x5 4x9",
                    "predicted_tok_s": 300.0, "measured_tok_s": 230.0, "perplexity": 23.0,
                    "workloads": [{"error_pct": 30.0, "profiled_error_pct": 3.0}]},
                   {"plan": "uniform", "stages": 0, "predicted_tok_s": None, "measured_tok_s": None,
                    "error": "no plan fits"}],
          "errors": {}, "calibration": None, "profiled_overhead": None}
    docs = [rows.afd(a, mono, afd), rows.spec(a, spec), rows.pq(a, pq),
            rows.quant(a, [{"bits": 4, "source": "rtn", "dtype": "bfloat16", "batch": 1, "output_tok_s": 9.0,
                            "tpot_ms": 1.0, "perplexity": 24.0},
                           {"kind": "linear", "name": "qkv", "shape": [960, 576], "bits": 4, "batch": 1, "us": 5.0}]),
            rows.engine(a, [{"impl": "tessera", "batch": 1, "input_len": 8, "output_len": 4, "dtype": "bfloat16",
                             "output_tok_s": 9.0}, {"impl": "transformers", "batch": 1, "input_len": 8,
                                                    "output_len": 4, "dtype": "float32", "output_tok_s": 3.0}])]
    for doc in docs:
        assert render.problems(doc) == [], doc["benchmark"]
    afd_doc, spec_doc, pq_doc, quant_doc, engine_doc = docs
    assert [r["simulated"] for r in afd_doc["rows"]] == [False, False, False, True, True]
    assert spec_doc["rows"] == [{**spec_doc["rows"][0], "baseline_tok_s": 10.0, "spec_tok_s": 15.0, "speedup": 1.5}]
    assert pq_doc["rows"][0]["bits"] == "16x21 4x9" and pq_doc["rows"][0]["devices"] == "dev-a, dev-b"
    assert quant_doc["rows"][0]["quantization"] == "int4" and quant_doc["rows"][1]["rows"] == 1
    assert engine_doc["rows"] == [{**engine_doc["rows"][0], "tok_s": 9.0, "reference_tok_s": 3.0}]
