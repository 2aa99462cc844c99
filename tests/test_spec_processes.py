"""Disaggregated speculative decoding through what a user runs: `tessera serve --speculative
self:2` (a draft worker, the target worker, the gateway) answers chat and completions, streamed
or not, with exactly the text a plain `tessera serve` gives under greedy decoding, and reports
accepted / rejected prediction tokens in usage, Info and /metrics. A draft worker SIGKILLed
mid-stream costs only speed: the stream completes with the same text, and speculation resumes
once the supervisor has restarted it. Malformed rounds sent straight to the draft worker are
refused (INVALID_ARGUMENT / FAILED_PRECONDITION), counted and never applied, and it keeps
serving. The DraftClient sends only new tokens, never applies a stale reply and pays one
timeout for a hung draft worker, not one per step; the gateway never routes to a draft worker;
the speculative topology pairs each target with its draft."""
from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import time
from concurrent import futures

import grpc
import httpx
import pytest

from servers import Logged, free_port, redis_server, wait_until

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_LEN = 2048      # the tiny random llama's context
CERTS = None        # the speculative stack's certificate directories (set by the stacks fixture)


def _openai(url: str):
    from openai import OpenAI
    return OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def stacks(tiny_models, tmp_path_factory):
    """(speculative serve, its URL, its draft address, plain URL): two `tessera serve`s of the
    tiny llama in float32, started side by side; the speculative one with certificates this
    test holds too (CERTS), so it can call its worker and draft worker."""
    from tessera.mtls.certs import write_role_dirs
    global CERTS
    CERTS = tmp_path_factory.mktemp("certs")
    write_role_dirs(CERTS, "serve", ("worker", "gateway", "draft-worker"))
    model = tiny_models["llama"]
    spec_port, plain_port, draft_port = free_port(), free_port(), free_port()
    common = ("--model", model, "--dtype", "float32", "--shutdown-grace-s", "2")
    spec = Logged("serve", *common, "--speculative", "self:2", "--port", str(spec_port), "--worker-port",
                  str(free_port()), "--draft-port", str(draft_port), "--restart-backoff-s", "0.2", "--certs", str(CERTS))
    plain = Logged("serve", *common, "--port", str(plain_port), "--worker-port", str(free_port()))
    try:
        spec_url, plain_url = f"http://127.0.0.1:{spec_port}", f"http://127.0.0.1:{plain_port}"
        spec.wait_for(rf"tessera draft worker ready on 127.0.0.1:{draft_port}", 120)
        wait_until(lambda: _healthy(spec_url) and _healthy(plain_url), 120, "the gateways never became healthy")
        yield spec, spec_url, f"127.0.0.1:{draft_port}", plain_url
    finally:
        spec.close(30)
        plain.close(30)


def _answers(url: str, max_tokens: int = 24) -> dict:
    """Greedy chat and completion, each plain and streamed: text and usage."""
    client, out = _openai(url), {}
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    args = dict(model="llama", max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(messages=messages, **args)
    out["chat"] = (r.choices[0].message.content, r.usage)
    r = client.completions.create(prompt="Once upon a time", **args)
    out["completion"] = (r.choices[0].text, r.usage)
    for kind, create, extra in (("chat_stream", client.chat.completions.create, {"messages": messages}),
                                ("completion_stream", client.completions.create, {"prompt": "Once upon a time"})):
        text, usage = "", None
        for chunk in create(stream=True, stream_options={"include_usage": True}, **extra, **args):
            usage = chunk.usage or usage
            if chunk.choices:
                text += (chunk.choices[0].delta.content or "") if kind == "chat_stream" else chunk.choices[0].text
        out[kind] = (text, usage)
    return out


def _metric(url: str, name: str) -> float:
    lines = [line for line in httpx.get(url + "/metrics").text.splitlines() if line.startswith(name + "{")]
    assert lines, f"{name} missing from {url}/metrics"
    return float(lines[0].split()[-1])


@pytest.mark.e2e
def test_speculative_serve_answers_exactly_like_plain_decoding(stacks):
    spec, spec_url, draft, plain_url = stacks
    fast, plain = _answers(spec_url), _answers(plain_url)
    for kind, (text, usage) in fast.items():
        assert text == plain[kind][0] and text, kind
        assert usage.completion_tokens == plain[kind][1].completion_tokens == 24, kind
        details = usage.completion_tokens_details
        # self:2 of a 2-layer model predicts the target itself: its best guesses are accepted
        assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens >= 0, kind
        assert plain[kind][1].completion_tokens_details is None, kind     # no speculation: no details
    rounds = _metric(spec_url, "tessera_spec_decode_num_drafts_total")
    emitted = _metric(spec_url, "tessera_spec_decode_acceptance_length_sum")
    assert rounds == _metric(spec_url, "tessera_spec_decode_acceptance_length_count") and 0 < rounds < 4 * 24
    assert emitted / rounds > 1      # more than one token per target forward, on average
    assert _metric(spec_url, "tessera_spec_decode_num_accepted_tokens_total") == \
        sum(u.completion_tokens_details.accepted_prediction_tokens for _, u in fast.values())

    from tessera.rpc.client import GrpcWorkerClient
    from tessera.mtls.links import holding
    worker = spec.wait_for(r"tessera worker ready on (\S+)")[1]
    with holding(CERTS / "gateway"):
        info = asyncio.run(GrpcWorkerClient(worker).info())
    assert info.speculative == f"self:2 @ {draft}" and info.spec_verify_rounds >= rounds
    assert info.spec_emitted_tokens > info.spec_accepted_tokens > 0


def _stub(address: str, as_worker: bool = False):
    """A draft worker's stub: as the stacks' worker (CERTS), or with no certificate."""
    from tessera import mtls
    from tessera.mtls.links import load
    from tessera.rpc.v1 import draft_pb2_grpc
    channel = mtls.channel(address, "draft-worker", ident=load(CERTS / "worker")) if as_worker else \
        grpc.insecure_channel(address)
    return draft_pb2_grpc.DraftWorkerStub(channel)


def _round(stub, request_id: str, round_: int, tokens, num_tokens: int, size: int = 4):
    from tessera.rpc.v1 import draft_pb2
    return stub.Round(draft_pb2.RoundRequest(request_id=request_id, round=round_, token_ids=tokens,
                                             num_tokens=num_tokens, size=size), timeout=10)


@pytest.mark.e2e
def test_malformed_rounds_are_refused_never_applied_and_the_draft_worker_keeps_serving(stacks):
    from tessera.rpc.v1 import draft_pb2
    _, spec_url, draft, _ = stacks
    stub = _stub(draft, as_worker=True)
    before = stub.Info(draft_pb2.DraftInfoRequest(), timeout=10)
    assert (before.role, before.layers, before.vocab_size, before.max_len) == ("draft", 2, 49152, MAX_LEN)
    reply = _round(stub, "probe", 10, [1, 2, 3, 4], 4)           # a new request: the whole sequence
    assert reply.round == 10 and 0 < len(reply.tokens) <= 3 and len(reply.parents) == len(reply.tokens)
    invalid, stale = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
    cases = [(("probe", 11, [5], 5, 0), invalid),                  # no room for even the root
             (("probe", 11, [5], 5, 5000), invalid),               # a tree nobody verifies
             (("probe", 11, [49152], 5, 4), invalid),              # outside the vocabulary
             (("probe", 11, [-1], 5, 4), invalid),
             (("probe", 11, [], 4, 4), invalid),                   # no new token
             (("", 11, [5], 5, 4), invalid),
             (("x" * 300, 1, [5], 1, 4), invalid),
             (("probe", 11, [5], MAX_LEN + 1, 4), invalid),        # longer than the draft's context
             (("probe", 10, [5], 5, 4), stale),                    # round not after the last
             (("probe", 9, [5], 5, 4), stale),
             (("probe", 11, [5, 6], 5, 4), stale),                 # 4 held + 2 new is not 5
             (("unknown", 1, [5], 3, 4), stale)]                   # a delta for a request not held
    for args, code in cases:
        with pytest.raises(grpc.RpcError) as e:
            _round(stub, *args)
        assert e.value.code() == code, (args, e.value.code(), e.value.details())
    reply = _round(stub, "probe", 12, [5], 5)     # nothing refused was applied: 4 held + 1 new
    assert reply.round == 12 and len(reply.tokens) <= 3
    after = stub.Info(draft_pb2.DraftInfoRequest(), timeout=10)
    assert after.refused - before.refused == len(cases) and after.rounds - before.rounds == 2
    stub.Finish(draft_pb2.FinishRequest(request_id="probe"), timeout=10)
    assert stub.Info(draft_pb2.DraftInfoRequest(), timeout=10).requests == after.requests - 1
    r = _openai(spec_url).chat.completions.create(model="llama", messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=8, temperature=0)
    assert r.usage.completion_tokens_details.accepted_prediction_tokens > 0     # it still drafts


@pytest.mark.e2e
def test_a_draft_worker_sigkilled_mid_stream_costs_only_speed(stacks):
    spec, spec_url, draft, plain_url = stacks
    args = dict(model="llama", messages=[{"role": "user", "content": "Count."}], max_tokens=300, temperature=0,
                stream=True, extra_body={"ignore_eos": True})
    expected = "".join(c.choices[0].delta.content or "" for c in _openai(plain_url).chat.completions.create(**args)
                       if c.choices)
    victim = spec.pid("draft-worker-0")
    text, finish, killed, after_kill, t0 = "", None, False, 0, time.monotonic()
    for chunk in _openai(spec_url).chat.completions.create(**args):
        if not chunk.choices:
            continue
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        if killed:
            after_kill += 1
        elif text:                      # the first words are out: the draft worker dies
            os.kill(victim, signal.SIGKILL)
            killed = True
    assert text == expected and finish == "length"
    assert after_kill > 10 and time.monotonic() - t0 < 60       # the stream went on, without a hang
    spec.wait_for(r"no draft this round, decoding plainly \(draft worker", 10)     # the target noticed, and decoded plainly
    spec.wait_for(r"draft-worker-0 \(pid \d+\) exited with signal SIGKILL", 10)
    spec.wait_for(rf"tessera draft worker ready on {draft}", 120, count=2)

    def speculating() -> bool:      # the client's back-off (at most 8 s) has passed: it drafts again
        r = _openai(spec_url).chat.completions.create(model="llama", max_tokens=8, temperature=0,
                                                      messages=[{"role": "user", "content": "Again."}])
        return r.usage.completion_tokens_details is not None
    wait_until(speculating, 30, "speculation never resumed after the draft worker restarted")


@pytest.mark.e2e
def test_up_runs_the_speculative_topology_over_mutual_tls(tiny_models, tmp_path):
    """`tessera up` (mutual TLS on every internal link, a Redis with a password): the target
    drafts through its draft worker, both register under the same model, the gateway routes
    only to the target, and a caller without the deployment's certificate drafts nothing."""
    import yaml
    spec = yaml.safe_load((ROOT / "deploy/topologies/speculative.yaml").read_text())
    spec.update(model=tiny_models["llama"], dtype="float32")
    spec["roles"]["draft_worker"].update(port=free_port(), speculative="self:2")
    spec["roles"]["target_worker"]["port"] = free_port()
    path, port = tmp_path / "speculative.yaml", free_port()
    path.write_text(yaml.safe_dump(spec))
    with redis_server(password="spec-test-pw") as redis:
        up = Logged("up", str(path), "--port", str(port), "--shutdown-grace-s", "2",
                    env=dict(os.environ, REDIS_URL=redis.url))
        _speculates_behind_the_gateway(up, port, spec, redis.url)


def _speculates_behind_the_gateway(up, port: int, spec: dict, redis_url: str) -> None:
    from tessera.registry import RedisRegistry
    try:
        url = f"http://127.0.0.1:{port}"
        up.wait_for("tessera draft worker ready", 120)
        wait_until(lambda: _healthy(url), 120, "the gateway never became healthy")
        r = _openai(url).chat.completions.create(model="llama", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=16, temperature=0)
        assert r.usage.completion_tokens_details.accepted_prediction_tokens > 0

        async def registered():
            assert "spec-test-pw" not in up.wait_for(r"tessera up: registry (\S+)")[1]
            registry = RedisRegistry(redis_url, prefix="tessera:speculative")
            try:
                return sorted((rec.role, rec.model) for rec in await registry.list())
            finally:
                await registry.close()
        assert asyncio.run(registered()) == [("draft", "llama"), ("worker", "llama")]
        assert _metric(url, "tessera_gateway_workers") == 1
        with pytest.raises(grpc.RpcError) as e:        # a round without a certificate drafts nothing
            _round(_stub(f"127.0.0.1:{spec['roles']['draft_worker']['port']}"), "r", 1, [1], 1)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        assert up.close(60) == 0


class _Scripted:
    """A DraftWorker servicer that records every round and answers as told (late, stale)."""

    def __init__(self) -> None:
        self.seen, self.stale, self.delay_s = [], False, 0.0

    def Round(self, request, context):
        from tessera.rpc.v1 import draft_pb2
        self.seen.append((request.round, list(request.token_ids), request.num_tokens))
        time.sleep(self.delay_s)
        answered = request.round - 1 if self.stale else request.round
        return draft_pb2.RoundReply(round=answered, tokens=[7, 8], parents=[0, 1])


@pytest.fixture
def scripted():
    """(a _Scripted draft worker, its address) on a free port."""
    from tessera.rpc.v1 import draft_pb2_grpc

    class Servicer(_Scripted, draft_pb2_grpc.DraftWorkerServicer):
        pass
    servicer, server = Servicer(), grpc.server(futures.ThreadPoolExecutor(4))
    draft_pb2_grpc.add_DraftWorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


def test_draft_client_sends_new_tokens_and_never_applies_a_stale_reply(scripted):
    from tessera.rpc.draft_client import DraftClient, DraftUnavailable
    from tessera.spec.tree import Draft
    servicer, address = scripted
    client = DraftClient(address, vocab_size=100)
    assert client.propose("r", [1, 2, 3], 3, 4) == Draft((7, 8), (0, 1))
    assert client.propose("r", [1, 2, 3, 4, 5], 2, 4) == Draft((7, 8), (0, 1))
    servicer.stale = True
    with pytest.raises(DraftUnavailable, match="stale"):
        client.propose("r", [1, 2, 3, 4, 5, 6], 1, 4)
    servicer.stale = False
    client.propose("r", [1, 2, 3, 4, 5, 6, 7], 1, 4)        # after a failure: the whole sequence again
    with pytest.raises(DraftUnavailable, match="exceeds"):    # 2 tokens + the root > size 2
        client.propose("s", [1], 1, 2)
    assert [s[1:] for s in servicer.seen] == [([1, 2, 3], 3), ([4, 5], 5), ([6], 6),
                                              ([1, 2, 3, 4, 5, 6, 7], 7), ([1], 1)]
    rounds = [s[0] for s in servicer.seen]
    assert rounds == sorted(set(rounds))                      # every round a new number
    with pytest.raises(DraftUnavailable, match="vocabulary"):     # token 8 of a vocabulary of 8
        DraftClient(address, vocab_size=8).propose("t", [1], 1, 4)


def test_a_hung_draft_worker_costs_one_timeout_not_one_per_step(scripted):
    from tessera.rpc.draft_client import DraftClient, DraftUnavailable
    from tessera.spec.tree import Draft
    servicer, address = scripted
    servicer.delay_s = 2.0                      # every round answers far too late
    client = DraftClient(address, timeout_s=0.3, backoff_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(DraftUnavailable, match="DEADLINE_EXCEEDED"):
        client.propose("r", [1, 2, 3], 3, 4)
    first, t0 = time.monotonic() - t0, time.monotonic()
    for step in range(50):                      # the steps of the next second: no call, no wait
        with pytest.raises(DraftUnavailable, match="failed recently"):
            client.propose("r", [1, 2, 3], 3, 4)
    assert 0.25 < first < 1.5 and time.monotonic() - t0 < 0.5 and len(servicer.seen) == 1   # 0.5: well inside the back-off
    time.sleep(1.0)
    with pytest.raises(DraftUnavailable, match="DEADLINE_EXCEEDED"):     # then it is tried again
        client.propose("r", [1, 2, 3], 3, 4)
    assert len(servicer.seen) == 2
    servicer.delay_s = 0.0
    time.sleep(2.1)                             # the back-off doubled after the second failure
    assert client.propose("r", [1, 2, 3], 3, 4) == Draft((7, 8), (0, 1))    # speculation resumes


def test_the_draft_client_and_its_in_process_twins_satisfy_one_protocol(tmp_path, request):
    """mypy: DraftClient (gRPC), SerialProposer and AsyncProposer (in process) are Proposers,
    and one whose propose forgets num_new is not."""
    import subprocess
    import sys
    import textwrap
    pytest.importorskip("mypy")
    (tmp_path / "uses.py").write_text(textwrap.dedent("""
        from typing import Sequence
        from tessera.rpc.draft_client import DraftClient
        from tessera.spec.proposer import AsyncProposer, Proposer, SerialProposer
        from tessera.spec.tree import Draft

        def all_proposers(remote: DraftClient, serial: SerialProposer, threaded: AsyncProposer) -> list[Proposer]:
            return [remote, serial, threaded]

        class Old(DraftClient):
            def propose(self, request_id: str, token_ids: Sequence[int], size: int) -> Draft | None:  # type: ignore[override]
                raise NotImplementedError

        def old(p: Old) -> Proposer:
            return p
    """))
    (tmp_path / "mypy.ini").write_text(textwrap.dedent(f"""
        [mypy]
        mypy_path = {ROOT / "services"}
        follow_imports = skip
        ignore_missing_imports = True
        [mypy-tessera.*]
        follow_imports = silent
    """))
    out = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir",
                          str(request.config.cache.mkdir("mypy")), "uses.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and 'got "Old", expected "Proposer"' in errors[0], out.stdout


def test_the_gateway_never_routes_to_a_draft_worker():
    from tessera.registry import MemoryRegistry, WorkerRecord
    from tessera.worker_pool import WorkerPool

    async def run():
        registry = MemoryRegistry()
        await registry.put(WorkerRecord("draft-0", "draft", "llama", "127.0.0.1:1", 8))
        await registry.put(WorkerRecord("target-0", "worker", "llama", "127.0.0.1:2", 8))
        await registry.put(WorkerRecord("attention-0", "attention", "llama", "127.0.0.1:3", 8))
        pool = WorkerPool(lambda address: address)
        watch = asyncio.create_task(pool.watch(registry, "llama", interval_s=0.01))
        await asyncio.sleep(0.1)
        watch.cancel()
        return sorted(pool.members)
    assert asyncio.run(run()) == ["127.0.0.1:2", "127.0.0.1:3"]


def test_prediction_tokens_add_up_across_a_failover():
    """A resumed attempt's worker counts accepted / rejected draft tokens from 0: the pool adds
    what the earlier attempt reported, so usage covers the whole generation."""
    from tessera.config import SamplingParams
    from tessera.worker_api import GenerateChunk, GenerateInput
    from tessera.worker_pool import _Progress
    progress, request = _Progress(), GenerateInput("r", SamplingParams(), token_ids=(1, 2))
    progress.attempt(request, 1)
    progress.seen(GenerateChunk("a", (5,), prompt_token_ids=(1, 2), accepted_tokens=1, rejected_tokens=3))
    progress.seen(GenerateChunk("b", (6, 7), accepted_tokens=3, rejected_tokens=4))
    progress.attempt(request, 2)
    last = progress.seen(GenerateChunk("c", (8, 9), prompt_token_ids=(1, 2, 5, 6, 7), accepted_tokens=1,
                                       rejected_tokens=0))
    assert (last.accepted_tokens, last.rejected_tokens) == (4, 4)


def test_speculative_topology_pairs_each_target_with_its_draft(tmp_path):
    import yaml

    from tessera.config import ConfigError
    from tessera.deploy.topology import Topology
    spec = yaml.safe_load((ROOT / "deploy/topologies/speculative.yaml").read_text())
    spec["roles"]["draft_worker"]["replicas"] = spec["roles"]["target_worker"]["replicas"] = 2
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(spec))
    procs = {p.name: p.argv for p in Topology.load(path).processes()}
    assert list(procs) == ["redis-0", "draft-worker-0", "draft-worker-1", "target-worker-0", "target-worker-1",
                           "gateway-0"]
    target = procs["target-worker-1"]
    assert target[0] == "target-worker" and target[target.index("--draft-address") + 1] == "127.0.0.1:50082"
    assert target[target.index("--speculative") + 1] == "self@int4" == procs["draft-worker-1"][
        procs["draft-worker-1"].index("--speculative") + 1]
    spec["roles"]["draft_worker"]["replicas"] = 1
    for bad in (spec, {**spec, "roles": {**spec["roles"], "draft_worker": {"port": 1}}},
                {**spec, "roles": {**spec["roles"], "target_worker": {"port": 2, "depth": 2}}}):
        path.write_text(yaml.safe_dump(bad))
        with pytest.raises(ConfigError, match="draft"):
            Topology.load(path)
