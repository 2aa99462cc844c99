"""Traces across the split topologies: `tessera up FILE --otlp-traces-endpoint URL --trace-level
detailed` for every file in deploy/topologies (vllm.yaml aside: its workers run from .venv-vllm, and
tests/test_vllm_engine.py traces its deployment),
each on a tiny random model, and one chat request with a traceparent through the official openai
client. Each gives one connected tree rooted at the client's span, with spans from every process
on the request's path, the response's usage on the request span, and the speculative round, AFD
step and pipeline stage spans under the parents tracing_detail.py and spec/traced.py describe."""
from __future__ import annotations

import os
import pathlib
import secrets
import subprocess
import sys
import time

import openai
import pytest
import torch
import yaml

import servers
from otlp_receiver import Receiver, attrs
from tessera import tracing_detail
from tessera.disagg.expert_shard import CONTROL_LAYER, control_message, read_control
from tessera.pipeline.wire import decode_step, encode_step, trace_context
from tessera.scheduler import ScheduledRequest, StepPlan
from tessera.transport.base import DISPATCH, Tag, TransportError

pytestmark = pytest.mark.e2e
ROOT = pathlib.Path(__file__).resolve().parents[1]
ROOT_NAME = "POST /v1/chat/completions"
GATEWAY = "tessera-gateway"
AFD = ({"afd.step", "afd.attention", "m2n.send", "m2n.recv", "afd.expert_step", "afd.expert"},
       {GATEWAY, "tessera-attention-node", "tessera-expert-node"})
# topology -> (span names beyond the gateway's and worker.generate, the services on the path)
TOPOLOGIES = {
    "single": ({"queue", "prefill", "decode"}, {GATEWAY, "tessera-worker"}),
    "speculative": ({"spec.round", "spec.draft", "spec.verify", "spec.draft_tree"},
                    {GATEWAY, "tessera-target-worker", "tessera-draft-worker"}),
    "disagg-dense": AFD,
    "disagg-moe": AFD,
    "pipeline-pq": ({"pipeline.step", "pipeline.compute", "m2n.send", "m2n.recv", "pipeline.stage"},
                    {GATEWAY, "tessera-pipeline-shard"}),
}


def test_every_topology_is_covered():
    files = {p.stem for p in (ROOT / "deploy/topologies").glob("*.yaml")}
    assert set(TOPOLOGIES) == files - {"vllm"}


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    yield r
    r.server.stop(0)


def _chat(url: str, traceparent: str | None):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    # 12 tokens, whatever the random model says: more than the first speculative round can emit
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                          max_tokens=12, temperature=0, extra_body={"ignore_eos": True},
                                          extra_headers={"traceparent": traceparent} if traceparent else None)


def _tree(receiver: Receiver, trace_id: str, client_span: str, names: set[str]) -> list:
    """The trace once it holds `names` and every span's parent (the root's: the client's span);
    checked again after the processes' next exports, so no late span hangs loose."""
    def connected() -> bool:
        spans = receiver.trace(trace_id)
        ids = {s.span_id.hex() for _, s in spans} | {client_span}
        return names <= {s.name for _, s in spans} and all(s.parent_span_id.hex() in ids for _, s in spans)
    servers.wait_until(connected, 30, f"a connected trace with spans {sorted(names)}")
    time.sleep(1.0)          # OTEL_BSP_SCHEDULE_DELAY is 0.2 s
    assert connected(), "a span arrived whose parent never did"
    return receiver.trace(trace_id)


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
def test_one_connected_tree_per_request(name, receiver, tiny_models, tmp_path):
    path = servers.tiny_topology(name, tiny_models, tmp_path)
    url = f"http://127.0.0.1:{yaml.safe_load(path.read_text())['roles']['gateway']['port']}"
    env = dict(os.environ, OTEL_BSP_SCHEDULE_DELAY="200")
    args = ["up", str(path), "--otlp-traces-endpoint", f"http://127.0.0.1:{receiver.port}", "--trace-level",
            "detailed", "--shutdown-grace-s", "2"]
    with servers._process(args, lambda: servers._http_ok(url + "/health", 30), 240, env=env):
        if name == "speculative":   # the draft worker may come up after the target's first rounds failed
            servers.wait_until(lambda: _chat(url, None).usage.completion_tokens_details is not None, 60,
                               "the target never drafted through its draft worker")
        trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
        response = _chat(url, f"00-{trace_id}-{client_span}-01")
        names, services = TOPOLOGIES[name]
        spans = _tree(receiver, trace_id, client_span, {ROOT_NAME, "route", "worker.generate"} | names)

    ids = {s.span_id.hex() for _, s in spans}
    roots = [s for _, s in spans if s.parent_span_id.hex() not in ids]
    assert [s.name for s in roots] == [ROOT_NAME] and roots[0].parent_span_id.hex() == client_span
    assert {r["service.name"] for r, _ in spans} == services
    a, usage = attrs(roots[0]), response.usage
    assert a["gen_ai.usage.input_tokens"] == usage.prompt_tokens > 0
    assert a["gen_ai.usage.output_tokens"] == usage.completion_tokens > 0
    (_, work), = [(r, s) for r, s in spans if s.name == "worker.generate"]
    CHECKS.get(name, lambda *_: None)(spans, work, usage)


def _named(spans: list, name: str, service: str | None = None) -> list:
    return [(r, s) for r, s in spans if s.name == name and service in (None, r["service.name"])]


def _ids(found: list) -> set[bytes]:
    return {s.span_id for _, s in found}


def _speculative(spans: list, work, usage) -> None:
    rounds = _named(spans, "spec.round")
    assert _ids(rounds) and all(s.parent_span_id == work.span_id for _, s in rounds)
    assert sorted(attrs(s)["tessera.spec.round"] for _, s in rounds) == list(range(1, len(rounds) + 1))
    drafts, verifies = _named(spans, "spec.draft"), _named(spans, "spec.verify")
    assert len(drafts) == len(rounds) and all(s.parent_span_id in _ids(rounds) for _, s in drafts + verifies)
    trees = _named(spans, "spec.draft_tree")
    assert {r["service.name"] for r, _ in trees} == {"tessera-draft-worker"}
    assert sorted(s.parent_span_id for _, s in trees) == sorted(_ids(drafts))   # one per round
    # every round but the last, whose tokens end the request, learns its accepted length
    measured = [attrs(s) for _, s in verifies if "tessera.spec.accepted_tokens" in attrs(s)]
    assert len(measured) == len(rounds) - 1 > 0
    assert all(0 <= v["tessera.spec.accepted_tokens"] <= v["tessera.spec.draft_tokens"] and
               v["tessera.spec.emitted_tokens"] == v["tessera.spec.accepted_tokens"] + 1 for v in measured)
    assert sum(v["tessera.spec.accepted_tokens"] for v in measured) <= \
        usage.completion_tokens_details.accepted_prediction_tokens
    assert 1 + sum(v["tessera.spec.emitted_tokens"] for v in measured) < usage.completion_tokens


def _afd(spans: list, work, usage) -> None:
    steps = _named(spans, "afd.step")
    assert len(steps) == usage.completion_tokens and all(s.parent_span_id == work.span_id for _, s in steps)
    for name in ("afd.attention", "m2n.send", "m2n.recv"):
        found = _named(spans, name, "tessera-attention-node")
        assert found and all(s.parent_span_id in _ids(steps) for _, s in found), name
    experts = _named(spans, "afd.expert_step")
    assert {r["tessera.replica"] for r, _ in experts} == {0, 1} and len(experts) == 2 * len(steps)
    assert all(s.parent_span_id in _ids(steps) for _, s in experts)
    computes = _named(spans, "afd.expert")
    assert computes and all(s.parent_span_id in _ids(experts) for _, s in computes)


def _pipeline(spans: list, work, usage) -> None:
    steps = _named(spans, "pipeline.step")
    assert len(steps) == usage.completion_tokens and all(s.parent_span_id == work.span_id for _, s in steps)
    first = [(r, s) for r, s in spans if r.get("tessera.stage") == 0 and s.name.startswith(("pipeline.", "m2n."))]
    assert {s.name for _, s in first} == {"pipeline.step", "pipeline.compute", "m2n.send", "m2n.recv"}
    assert all(s.parent_span_id in _ids(steps) for _, s in first if s.name != "pipeline.step")
    stages = _named(spans, "pipeline.stage")
    assert {r["tessera.stage"] for r, _ in stages} == {1} and len(stages) == len(steps)
    sends = _ids([(r, s) for r, s in first if s.name == "m2n.send"])
    assert all(s.parent_span_id in sends for _, s in stages)
    later = [(r, s) for r, s in spans if r.get("tessera.stage") == 1 and s.name != "pipeline.stage"]
    assert {s.name for _, s in later} == {"pipeline.compute", "m2n.send"}
    assert all(s.parent_span_id in _ids(stages) for _, s in later)


CHECKS = {"speculative": _speculative, "disagg-dense": _afd, "disagg-moe": _afd, "pipeline-pq": _pipeline}


def test_m2n_messages_carry_the_trace_context():
    context = (-5, 7, -(1 << 63), 1)
    plan = StepPlan((ScheduledRequest("", (5,), 9, (0, 1, 2), True),))
    message = encode_step(plan, torch.randn(1, 8), 2, context)
    assert decode_step(message, 8, torch.float32, 4)[0] == 2 and trace_context(message) == context
    assert trace_context(encode_step(plan, torch.randn(1, 8), 2)) == tracing_detail.NONE
    tag = Tag(3, 0, CONTROL_LAYER, DISPATCH)
    assert read_control(tag, control_message(2, context), "a") == (2, context)
    assert read_control(tag, control_message(2), "a") == (2, None) == read_control(tag, torch.tensor([2.0]), "a")
    for bad in (torch.tensor([2.0, 1.0]), torch.zeros(5)):   # the context only as int64 words
        with pytest.raises(TransportError, match="control message"):
            read_control(tag, bad, "a")


LEVEL_SCRIPT = '''
from tessera import tracing, tracing_detail
from tessera.scheduler import ScheduledRequest, StepPlan
from tessera.spec.proposer import traced
assert tracing.configure("attention-node", "http://127.0.0.1:%d")
work = tracing.server_span("worker.generate", {}, **{"tessera.request_id": "r"})
with tracing_detail.step("afd.step", StepPlan((ScheduledRequest("r", (1,), 0, (0,), True),))) as step:
    assert step is None and tracing.worker_span("r") is None and tracing.outgoing_metadata() == ()
proposer = object()
assert traced(proposer) is proposer
tracing.end_generation(work, None, 1, 1, "stop")
from opentelemetry import trace
trace.get_tracer_provider().shutdown()
'''


def test_the_request_level_records_no_step_or_round_spans():
    """The default level: a worker span, and nothing per step or round (no span per token)."""
    receiver = Receiver()
    try:
        subprocess.run([sys.executable, "-c", LEVEL_SCRIPT % receiver.port], check=True, timeout=60)
        assert [s.name for _, s in receiver.spans] == ["worker.generate"]
    finally:
        receiver.server.stop(0)
