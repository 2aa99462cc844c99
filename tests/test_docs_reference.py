"""The reference pages cannot fall behind the code: docs/observability.md names every metric the
processes define, and the CLI and OpenAPI pages the docs build generates (docs/hooks/) cover
every command, option, path and method. The hooks' render functions are called directly; the
site itself is built by `mkdocs build --strict`."""
from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SERVICES = ROOT / "services" / "tessera"
# The modules that define Prometheus metrics (defined_metrics() reads each one's collectors).
METRIC_MODULES = {"metrics.py", "pipeline/metrics.py"}


def load_hook(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_hook_{name}", ROOT / "docs" / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Info:
    """Any engine / stage / draft info: every field 1, ids strings."""
    model_id = "m"
    stage_index = 0

    def __getattr__(self, name):
        return 1


class _Source:
    refused = {"malformed": 0, "out_of_sync": 0}
    stats = _Info()

    def info(self):
        return _Info()


def defined_metrics() -> set[str]:
    """Every metric name as a scrape shows it (a counter's with _total), from the gateway's
    registry and each collector fed a stand-in engine, stage and draft worker."""
    from prometheus_client import CollectorRegistry, generate_latest

    from tessera.metrics import DraftCollector, GatewayMetrics, WorkerCollector
    from tessera.pipeline.metrics import PipelineShardCollector
    registries = [GatewayMetrics("m").registry]
    for collector in (WorkerCollector(_Source(), "worker"), DraftCollector(_Source(), _Info()),
                      PipelineShardCollector(_Source())):
        registry = CollectorRegistry()
        registry.register(collector)
        registries.append(registry)
    text = "".join(generate_latest(r).decode() for r in registries)
    return {name for name in re.findall(r"^# TYPE (\S+) \S+$", text, re.M) if not name.endswith("_created")}


def test_metrics_are_defined_only_where_this_test_looks():
    users = {str(p.relative_to(SERVICES)) for p in SERVICES.rglob("*.py")
             if "prometheus_client" in p.read_text() and "bench" not in p.parts}
    assert users == METRIC_MODULES, "a new module defines metrics: add its collectors to defined_metrics()"
    import tessera.metrics
    import tessera.pipeline.metrics
    collectors = {name for module in (tessera.metrics, tessera.pipeline.metrics)
                  for name, obj in vars(module).items()
                  if isinstance(obj, type) and obj.__module__ == module.__name__ and hasattr(obj, "collect")}
    assert collectors == {"WorkerCollector", "DraftCollector", "PipelineShardCollector"}


def test_observability_page_names_every_metric():
    page = (ROOT / "docs" / "observability.md").read_text()
    names = defined_metrics()
    assert len(names) > 40
    missing = sorted(n for n in names if f"`{n}`" not in page)
    assert not missing, f"docs/observability.md does not name: {missing}"
    named = set(re.findall(r"`(tessera_[a-z0-9_]+)`", page))
    prefixes = {"tessera_gateway_", "tessera_worker_", "tessera_draft_worker_", "tessera_pipeline_shard_",
                "tessera_request_", "tessera_spec_decode_"}
    stale = sorted(n for n in named - names if n.rstrip("_") not in {p.rstrip("_") for p in prefixes})
    assert not stale, f"docs/observability.md names metrics the code does not define: {stale}"


@pytest.fixture(scope="module")
def cli():
    hook = load_hook("cli_reference")
    parser = hook.build_parser()
    return hook, parser, hook.render(parser)


def _section(page: str, heading: str) -> str:
    start = page.index(heading)
    following = re.search(r"^#{2,3} ", page[start + len(heading):], re.M)
    return page[start:start + len(heading) + following.start()] if following else page[start:]


def test_cli_reference_covers_every_command_and_option(cli):
    hook, parser, page = cli
    paths = [path for path, _, _ in hook.commands(parser)]
    assert ("tessera", "serve") in paths and ("tessera", "bench", "serve") in paths
    for path, sub, _ in hook.commands(parser):
        heading = f"{' '.join(path)} {{#{hook.anchor(path)}}}"
        assert re.search(rf"^#{{2,3}} {re.escape(heading)}$", page, re.M), f"no section for {' '.join(path)}"
        section = _section(page, heading)
        assert f"usage: {sub.prog}" in section
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name in action.choices:
                    assert f"(#{hook.anchor(path + (name,))})" in section, f"{' '.join(path)} omits {name}"
            for option in action.option_strings:
                assert f"`{option}`" in section, f"{' '.join(path)}: {option} missing"


def test_cli_reference_shows_defaults_and_choices(cli):
    _, _, page = cli
    serve = _section(page, "tessera serve {#tessera-serve}")
    assert "| `--dtype` *str* | `auto` | `auto`, `float32`, `bfloat16` |" in serve
    assert "`--pin-threads`, `--no-pin-threads` | `True` |" in serve


def test_openapi_reference_covers_every_path_and_method(tmp_path):
    from tessera.openai_api import openapi_export
    out = tmp_path / "openapi.json"
    assert openapi_export.main(["--out", str(out)]) == 0
    schema = json.loads(out.read_text())
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"} <= set(schema["paths"])
    hook = load_hook("openapi_reference")
    page = hook.render(schema)
    for path, methods in schema["paths"].items():
        for method in methods:
            assert f"### {method.upper()} {path} {{#{hook.operation_anchor(method, path)}}}" in page
    for name, component in schema["components"]["schemas"].items():
        section = page[page.index(f"### {name} {{#{hook.schema_anchor(name)}}}"):]
        for field in component.get("properties", {}):
            assert f"| `{field}` |" in section, f"{name}.{field} missing"
