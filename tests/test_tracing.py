"""OpenTelemetry traces end to end: `tessera serve --otlp-traces-endpoint` exporting with the real
OTLP/gRPC exporters to a trace receiver in this process (opentelemetry-proto's TraceService),
driven by the official openai client with a W3C traceparent."""
from __future__ import annotations

import json
import re
import secrets
import threading
import time

import httpx
import openai
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

import servers
from otlp_receiver import Receiver, attrs, value
from tessera import tracing
from tessera.config import ConfigError
from tessera.deploy.topology import Topology

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
ROOT_NAME = "POST /v1/chat/completions"
WORKER_PHASES = {"worker.generate", "queue", "prefill", "decode"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    receiver = Receiver()
    log = tmp_path_factory.mktemp("tracing") / "serve.log"
    port, worker_port = servers.free_port(), servers.free_port()
    url = f"http://127.0.0.1:{port}"
    with pytest.MonkeyPatch.context() as mp, open(log, "wb") as stderr:
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")     # export within 0.2 s, not 5 s
        with servers._process(["serve", "--port", str(port), "--worker-port", str(worker_port), "--max-model-len",
                               "1024", "--otlp-traces-endpoint", f"http://127.0.0.1:{receiver.port}"],
                              lambda: servers._http_ok(url + "/health", 30), 180, stderr=stderr):
            yield url, receiver, log
    receiver.server.stop(0)


def chat(url: str, headers: dict):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0,
        extra_headers=headers)
    return raw, raw.parse()


def test_one_connected_tree_rooted_at_the_clients_span(served):
    url, receiver, log = served
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    raw, response = chat(url, {"traceparent": f"00-{trace_id}-{client_span}-01", "x-request-id": "traced-1"})
    assert raw.headers[tracing.RESPONSE_HEADER] == trace_id
    spans = receiver.wait_for(trace_id, {ROOT_NAME, "admission", "route"} | WORKER_PHASES)

    by_id = {s.span_id.hex(): (r, s) for r, s in spans}
    roots = [s for _, s in spans if s.parent_span_id.hex() not in by_id]
    assert [s.name for s in roots] == [ROOT_NAME]
    assert roots[0].parent_span_id.hex() == client_span
    services = {r["service.name"] for r, _ in spans}
    assert services == {"tessera-gateway", "tessera-worker"}

    def one(name: str):
        found = [(r, s) for r, s in spans if s.name == name]
        assert len(found) == 1, name
        return found[0]
    _, root = one(ROOT_NAME)
    _, route = one("route")
    worker_resource, work = one("worker.generate")
    assert worker_resource["service.name"] == "tessera-worker" and worker_resource["tessera.role"] == "worker"
    assert route.parent_span_id == root.span_id and work.parent_span_id == route.span_id
    for phase in ("queue", "prefill", "decode"):
        assert one(phase)[1].parent_span_id == work.span_id
    assert attrs(route)["tessera.worker.address"].startswith("127.0.0.1:")

    usage = response.usage
    a = attrs(root)
    assert a["gen_ai.request.model"] == MODEL and a["http.response.status_code"] == 200
    assert a["gen_ai.usage.input_tokens"] == usage.prompt_tokens > 0
    assert a["gen_ai.usage.output_tokens"] == usage.completion_tokens > 0
    assert a["gen_ai.response.finish_reasons"] == [response.choices[0].finish_reason]
    assert attrs(work)["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert attrs(one("prefill")[1])["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert attrs(one("decode")[1])["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert "Say hello" not in str(spans)        # no prompt text in spans

    # every log line of the request, in both processes, names its trace and the span it was written in
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    mine = [x for x in lines if x.get("request_id") == "traced-1"]
    assert {x["msg"] for x in mine} >= {"request", "generate", "generate done"}
    assert all(x.get("trace_id") == trace_id and x.get("span_id") in by_id for x in mine)
    assert {x["span_id"] for x in mine if x["msg"] == "generate done"} == {work.span_id.hex()}


@pytest.mark.parametrize("header", ["00-zzzz-bad", "00-" + "0" * 32 + "-" + "1" * 16 + "-01", "ff" * 40])
def test_a_malformed_traceparent_starts_a_new_trace(served, header):
    url, receiver, _ = served
    raw, response = chat(url, {"traceparent": header})
    assert raw.http_response.status_code == 200 and response.choices[0].message.content is not None
    trace_id = raw.headers[tracing.RESPONSE_HEADER]
    assert re.fullmatch(r"[0-9a-f]{32}", trace_id) and trace_id != "0" * 32
    spans = receiver.wait_for(trace_id, {ROOT_NAME, "worker.generate"})
    root = [s for _, s in spans if s.name == ROOT_NAME][0]
    assert root.parent_span_id == b""


def test_latency_histograms_carry_the_trace_id_as_an_exemplar(served):
    """OpenMetrics (what Prometheus asks for) shows each latency histogram's last observation
    with its request's trace id; the classic text format has no exemplars."""
    url, _, _ = served
    trace_id = secrets.token_hex(16)
    chat(url, {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
    scrape = httpx.get(url + "/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
    assert scrape.headers["content-type"].startswith("application/openmetrics-text")
    for histogram in ("tessera_time_to_first_token_seconds", "tessera_inter_token_latency_seconds",
                      "tessera_e2e_request_latency_seconds"):
        exemplars = re.findall(histogram + r'_bucket\{[^}]*\} \S+ # \{span_id="[0-9a-f]{16}",trace_id="([0-9a-f]{32})"\}',
                               scrape.text)
        assert trace_id in exemplars, histogram
    assert "# {trace_id=" not in httpx.get(url + "/metrics").text


def test_a_receiver_that_hangs_costs_requests_nothing(served):
    """Exports block in the receiver: requests answer as before, and the exporters' failures
    are logged once, not once a batch."""
    url, receiver, log = served
    before = log.read_text(errors="replace").count("export")
    receiver.hang.set()
    try:
        for _ in range(4):
            t0 = time.monotonic()
            raw, response = chat(url, {})
            assert raw.http_response.status_code == 200 and response.usage.completion_tokens > 0
            assert time.monotonic() - t0 < 10
            time.sleep(1.0)            # several export batches time out meanwhile
        servers.wait_until(lambda: log.read_text(errors="replace").count("export") > before, 20,
                           "the exporters' failure in the log")
        time.sleep(3.0)
        failures = [line for line in log.read_text(errors="replace").splitlines()[-200:] if "export" in line]
        assert 1 <= len(failures) <= 2, failures        # at most one per process (gateway, worker)
    finally:
        receiver.hang.clear()
        receiver.release.set()


def test_tracing_on_without_a_receiver_still_answers(served):
    """The receiver goes away: requests answer as before (the exporter drops its batches)."""
    url, receiver, _ = served
    receiver.server.stop(0).wait()
    for _ in range(3):
        t0 = time.monotonic()
        raw, response = chat(url, {})
        assert raw.http_response.status_code == 200 and response.usage.completion_tokens > 0
        assert time.monotonic() - t0 < 10


def test_off_without_an_endpoint(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert tracing.configure("worker", None) is False and not tracing.enabled()
    with tracing.request_span("GET /v1/models", {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"},
                              {}) as span:
        assert span is None
    assert tracing.client_span("route", "127.0.0.1:1") == (None, {})


def test_tessera_up_hands_the_endpoint_to_every_process(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("name: t\nroles:\n  redis: {port: 6379}\n  worker: {replicas: 2, port: 50051}\n"
                    "  gateway: {port: 8000}\n")
    procs = Topology.load(path).with_overrides(otlp_traces_endpoint="http://collector:4317").processes()
    for p in procs:
        if p.role == "redis":
            assert "--otlp-traces-endpoint" not in p.argv
        else:
            i = p.argv.index("--otlp-traces-endpoint")
            assert p.argv[i + 1] == "http://collector:4317"
            assert p.argv[p.argv.index("--trace-replica") + 1] == p.name.rsplit("-", 1)[1]
    assert all("--otlp-traces-endpoint" not in p.argv for p in Topology.load(path).processes())
    detailed = Topology.load(path).with_overrides(otlp_traces_endpoint="http://c:4317", trace_level="detailed")
    assert all(p.argv[p.argv.index("--trace-level") + 1] == "detailed"
               for p in detailed.processes() if p.role != "redis")
    path.write_text(path.read_text() + "trace_level: everything\n")
    with pytest.raises(ConfigError, match="trace_level"):
        Topology.load(path)


def test_http_protobuf_exporter_service_name_override_and_replica(tmp_path):
    """OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf: the flag's URL gets /v1/traces; OTEL_SERVICE_NAME wins."""
    import http.server
    import os
    import subprocess
    import sys
    got: list = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            got.append((self.path, trace_service_pb2.ExportTraceServiceRequest.FromString(body)))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    script = ("from tessera import tracing\n"
              f"assert tracing.configure('worker', 'http://127.0.0.1:{server.server_port}', replica=3)\n"
              "with tracing.request_span('GET /v1/models', {}, {}):\n    pass\n"
              "from opentelemetry import trace\ntrace.get_tracer_provider().shutdown()\n")
    env = dict(os.environ, OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf", OTEL_SERVICE_NAME="my-worker")
    try:
        subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)
    finally:
        server.shutdown()
    assert [path for path, _ in got] == ["/v1/traces"]
    resource = {kv.key: value(kv.value) for kv in got[0][1].resource_spans[0].resource.attributes}
    assert resource["service.name"] == "my-worker" and resource["tessera.replica"] == 3
    assert got[0][1].resource_spans[0].scope_spans[0].spans[0].name == "GET /v1/models"


FAILOVER_SCRIPT = '''
import asyncio
from tessera import tracing
from tessera.config import ConfigError
from tessera.config import SamplingParams
from tessera.worker_api import GenerateChunk, GenerateInput, Unavailable, WorkerInfo
from tessera.worker_pool import WorkerPool

class Worker:
    def __init__(self, address):
        self.address = address
    async def info(self, timeout_s=5.0):
        return WorkerInfo("m", 64, 8, 16, compat="same")
    async def generate(self, request):
        if self.address == "first:1":
            yield GenerateChunk("a", (7,), prompt_tokens=2, prompt_token_ids=(5, 6))
            raise Unavailable("worker died")
        yield GenerateChunk("b", (8,), finish_reason="length", prompt_tokens=2, prompt_token_ids=(5, 6))
    async def close(self):
        pass

async def main():
    pool = WorkerPool(Worker, ["first:1", "second:2"])
    with tracing.request_span("POST /v1/completions", {}, {}):
        request = GenerateInput("r", SamplingParams(temperature=0, max_tokens=2), token_ids=(5, 6))
        print([c.text async for c in pool.generate(request)])

assert tracing.configure("gateway", "http://127.0.0.1:%d")
asyncio.run(main())
from opentelemetry import trace
trace.get_tracer_provider().shutdown()
'''


def test_a_failover_is_an_event_of_the_request_span():
    import subprocess
    import sys
    receiver = Receiver()
    try:
        out = subprocess.run([sys.executable, "-c", FAILOVER_SCRIPT % receiver.port], check=True, timeout=60,
                             capture_output=True, text=True).stdout
        assert "['a', 'b']" in out
        (_, root), = [(r, s) for r, s in receiver.spans if s.name == "POST /v1/completions"]
    finally:
        receiver.server.stop(0)
    (cut,) = [e for e in root.events if e.name == "failover"]
    assert attrs(cut)["tessera.worker.address"] == "first:1" and attrs(cut)["error.type"] == "Unavailable"
    assert attrs(cut)["tessera.generated_tokens"] == 1
