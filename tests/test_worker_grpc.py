"""The worker's gRPC surface as a real process: Info, Generate, Abort, errors as statuses, health."""
from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servers import tessera_worker
from tessera.rpc.v1 import common_pb2, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def worker_address(tiny_models):
    with tessera_worker("--model", tiny_models["llama"], "--dtype", "float32", "--num-kv-blocks", "64",
                        "--block-size", "8") as (addr, _):
        yield addr


@pytest.fixture(scope="module")
def stub(worker_address):
    with grpc.insecure_channel(worker_address) as channel:
        yield worker_pb2_grpc.WorkerStub(channel), health_pb2_grpc.HealthStub(channel)


def cpu_flags(cpuinfo: str) -> set[str]:
    return {f for line in cpuinfo.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}


def test_auto_dtype_is_bfloat16_iff_the_cpu_runs_bf16_linears_at_float32_speed(monkeypatch):
    """The rule, on this machine's flags and on made-up ones, never one machine's answer; and
    vLLM's own auto, which is bf16 only where the CPU multiplies it (its bf16 is emulated
    elsewhere)."""
    import os

    import torch

    from tessera import engine
    from tessera.vllm_backend.engine import vllm_dtype
    from tessera_kernels import cbuild, tile_linear
    here = cpu_flags(open("/proc/cpuinfo").read()) if os.path.exists("/proc/cpuinfo") else set()
    native_here = bool(here & {"amx_bf16", "avx512_bf16"})
    want = torch.bfloat16 if native_here or tile_linear.available(torch.bfloat16) else torch.float32
    assert engine.resolve_dtype("auto") == want
    assert vllm_dtype("auto") == ("bfloat16" if native_here else "float32")
    for flags, tiles, dtype, vllm in (("fpu sse avx2 fma", True, torch.bfloat16, "float32"),       # AVX2 (Zen 3)
                                      ("fpu sse avx2 fma", False, torch.float32, "float32"),      # ... no compiler
                                      ("fpu sse avx2 avx512f", True, torch.bfloat16, "float32"),  # Cascade Lake
                                      ("fpu sse", False, torch.float32, "float32"),
                                      ("avx512f avx512_bf16", False, torch.bfloat16, "bfloat16"),
                                      ("amx_tile amx_bf16 amx_int8", False, torch.bfloat16, "bfloat16")):
        monkeypatch.setattr(cbuild, "_cpu_id", lambda: f"processor\t: 0\nflags\t\t: {flags}\n".encode())
        monkeypatch.setattr(tile_linear, "available", lambda dtype: tiles)
        cbuild.cpu_flags.cache_clear()
        assert engine.resolve_dtype("auto") == dtype, flags
        assert vllm_dtype("auto") == vllm and vllm_dtype("bfloat16") == "bfloat16", flags
    cbuild.cpu_flags.cache_clear()
    assert engine.resolve_dtype("float32") == torch.float32 and engine.resolve_dtype("bfloat16") == torch.bfloat16


def greedy(max_tokens: int, **kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0, top_p=1, repetition_penalty=1, max_tokens=max_tokens,
                                     ignore_eos=True, logprobs=-1, **kw)


def test_info_and_health(stub):
    worker, health = stub
    info = worker.Info(worker_pb2.InfoRequest(), timeout=5)
    assert info.num_kv_blocks == 64 and info.kv_block_size == 8 and info.num_free_kv_blocks == 64
    assert info.max_model_len == 2048 and info.dtype == "float32"
    assert health.Check(health_pb2.HealthCheckRequest(service="tessera.rpc.v1.Worker"), timeout=5).status == \
        health_pb2.HealthCheckResponse.SERVING


def test_generate_streams_deltas_then_usage(stub):
    worker, _ = stub
    req = worker_pb2.GenerateRequest(request_id="g1", token_ids=common_pb2.TokenIds(ids=[1, 2, 3]),
                                     sampling=greedy(6))
    msgs = list(worker.Generate(req, timeout=60))
    assert list(msgs[0].prompt_token_ids) == [1, 2, 3]
    assert sum(len(m.token_ids) for m in msgs) == 6
    assert msgs[-1].finish_reason == "length" and msgs[-1].usage.completion_tokens == 6
    assert all(not m.finish_reason for m in msgs[:-1])


def test_cancelled_call_frees_blocks(stub):
    worker, _ = stub
    req = worker_pb2.GenerateRequest(request_id="long", token_ids=common_pb2.TokenIds(ids=[4, 5, 6]),
                                     sampling=greedy(500))
    call = worker.Generate(req, timeout=60)
    next(call)
    call.cancel()
    import time
    deadline = time.monotonic() + 10
    while worker.Info(worker_pb2.InfoRequest(), timeout=5).num_free_kv_blocks != 64:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_bad_parameters_are_invalid_argument(stub):
    worker, _ = stub
    # max_tokens 0 means 'up to the context limit' (common.proto), so min > max needs a set max
    bad = [greedy(2, min_tokens=5), common_pb2.SamplingParams(temperature=-1, top_p=1, max_tokens=4, logprobs=-1),
           greedy(5000)]
    for sampling in bad:
        req = worker_pb2.GenerateRequest(request_id="bad", token_ids=common_pb2.TokenIds(ids=[1]), sampling=sampling)
        with pytest.raises(grpc.RpcError) as e:
            list(worker.Generate(req, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    req = worker_pb2.GenerateRequest(request_id="oob", token_ids=common_pb2.TokenIds(ids=[10**6]), sampling=greedy(2))
    with pytest.raises(grpc.RpcError) as e:
        list(worker.Generate(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert worker.Abort(worker_pb2.AbortRequest(request_id="nope"), timeout=5) is not None


class _Outgoing:
    """A Session's request stream, fed by the test as it goes (None ends it)."""

    def __init__(self) -> None:
        import queue
        self.q = queue.SimpleQueue()

    def send(self, msg) -> None:
        self.q.put(msg)

    def __iter__(self):
        while (msg := self.q.get()) is not None:
            yield msg


def _generate(rid: str, ids: list[int], sampling) -> worker_pb2.SessionRequest:
    return worker_pb2.SessionRequest(generate=worker_pb2.GenerateRequest(
        request_id=rid, token_ids=common_pb2.TokenIds(ids=ids), sampling=sampling))


def test_a_session_carries_many_generations_in_one_message_per_step(stub):
    """Four greedy generations and a bad one over one Session: each gets the tokens its own
    Generate call gets, the bad one its INVALID_ARGUMENT, and the updates of concurrent
    requests share messages (one per engine step, not one per request and token)."""
    worker, _ = stub
    prompts = {f"s{i}": [1 + i, 2, 3 + i] for i in range(4)}
    alone = {rid: [t for m in worker.Generate(worker_pb2.GenerateRequest(
        request_id=rid + "-alone", token_ids=common_pb2.TokenIds(ids=ids), sampling=greedy(6)), timeout=60)
        for t in m.token_ids] for rid, ids in prompts.items()}
    out = _Outgoing()
    for rid, ids in prompts.items():
        out.send(_generate(rid, ids, greedy(6)))
    out.send(_generate("bad", [1], greedy(2, min_tokens=5)))
    tokens, finish, errors, messages, updates = {}, {}, {}, 0, 0
    call = worker.Session(iter(out), timeout=60)
    for msg in call:
        messages += 1
        for u in msg.updates:
            updates += 1
            if u.error_code:
                errors[u.request_id] = grpc.StatusCode.INVALID_ARGUMENT.value[0] == u.error_code
            tokens.setdefault(u.request_id, []).extend(u.output.token_ids)
            if u.output.finish_reason:
                finish[u.request_id] = u.output.finish_reason
        if len(finish) == len(prompts) and errors:
            out.send(None)
    assert errors == {"bad": True}
    assert finish == dict.fromkeys(prompts, "length")
    assert {rid: tokens[rid] for rid in prompts} == alone
    assert messages <= updates / 2, (messages, updates)


def test_a_session_abort_frees_the_request_and_the_session_goes_on(stub):
    import time
    worker, _ = stub
    out = _Outgoing()
    out.send(_generate("long", [4, 5, 6], greedy(500)))
    call = worker.Session(iter(out), timeout=60)
    first = next(call)
    assert first.updates[0].request_id == "long"
    out.send(worker_pb2.SessionRequest(abort="long"))
    deadline = time.monotonic() + 10
    while worker.Info(worker_pb2.InfoRequest(), timeout=5).num_free_kv_blocks != 64:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    out.send(_generate("next", [7, 8], greedy(3)))
    got = []
    for msg in call:
        got += [u for u in msg.updates if u.request_id == "next"]
        if got and got[-1].output.finish_reason:
            break
    assert sum(len(u.output.token_ids) for u in got) == 3 and got[-1].output.finish_reason == "length"
    call.cancel()


def test_a_session_request_that_raises_ends_alone_with_a_500():
    """A bug in one generation (not a WorkerError) ends that request at once with INTERNAL;
    the other request of the session completes."""
    import asyncio

    from tessera.entrypoints.worker import WorkerServicer
    from tessera.worker_api import GenerateChunk

    class Engine:
        async def generate(self, req):
            if req.request_id == "bad":
                raise RuntimeError("boom")
            yield GenerateChunk("x", (1,), finish_reason="length", completion_tokens=1)

    async def run():
        async def requests():
            for rid in ("bad", "good"):
                yield _generate(rid, [1], greedy(1))
        updates = {}
        async for msg in WorkerServicer(Engine()).Session(requests(), None):
            updates.update((u.request_id, u) for u in msg.updates)
        return updates
    updates = asyncio.run(asyncio.wait_for(run(), 10))
    assert updates["bad"].error_code == grpc.StatusCode.INTERNAL.value[0]
    assert updates["good"].output.finish_reason == "length" and not updates["good"].error_code


def test_session_messages_stay_under_the_size_cap(monkeypatch):
    from tessera.entrypoints import worker
    monkeypatch.setattr(worker, "MESSAGE_BYTES", 1000)
    updates = [worker_pb2.SessionUpdate(request_id=f"r{i}", output=worker_pb2.GenerateResponse(text="y" * 300))
               for i in range(10)]
    messages = worker._messages(updates)
    assert [u.request_id for m in messages for u in m.updates] == [u.request_id for u in updates]
    assert len(messages) > 1 and all(m.ByteSize() <= 1000 + 400 for m in messages)


def test_a_worker_without_session_is_served_over_generate():
    """A worker of an older version has no Session RPC (the server answers UNIMPLEMENTED): the
    gateway's client falls back to one Generate stream per request, errors included, and stays
    on it."""
    import asyncio

    from tessera.config import SamplingParams
    from tessera.entrypoints.worker import WorkerServicer
    from tessera.rpc.client import GrpcWorkerClient
    from tessera.worker_api import GenerateChunk, GenerateInput, InvalidRequest

    class Engine:
        async def generate(self, req):
            if req.request_id == "bad":
                raise InvalidRequest("max_tokens must be at least 1", "max_tokens")
            for i in range(3):
                yield GenerateChunk(f"{req.request_id}.{i}", (i,), finish_reason="length" if i == 2 else None,
                                    completion_tokens=i + 1)

    servicer = WorkerServicer(Engine())
    only_generate = grpc.method_handlers_generic_handler("tessera.rpc.v1.Worker", {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=worker_pb2.GenerateRequest.FromString,
            response_serializer=worker_pb2.GenerateResponse.SerializeToString)})

    async def text(client, rid):
        req = GenerateInput(request_id=rid, sampling=SamplingParams(max_tokens=3), token_ids=(1, 2))
        return "".join([c.text async for c in client.generate(req)])

    async def run():
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((only_generate,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = GrpcWorkerClient(f"127.0.0.1:{port}")
        try:
            first = await asyncio.gather(*(text(client, f"r{i}") for i in range(3)))
            with pytest.raises(InvalidRequest) as bad:
                await text(client, "bad")
            return first, await text(client, "later"), bad.value.param, client._no_session
        finally:
            await client.close()
            await server.stop(None)
    first, later, param, fell_back = asyncio.run(asyncio.wait_for(run(), 30))
    assert first == [f"r{i}.0r{i}.1r{i}.2" for i in range(3)] and later == "later.0later.1later.2"
    assert param == "max_tokens" and fell_back


def test_a_silent_session_is_abandoned_and_the_next_request_opens_a_new_one():
    """A worker whose session stream hangs (connected, sends nothing): each open request ends
    Unavailable after the idle timeout (the gateway fails it over), the session is given up,
    and the next request does not queue behind the dead stream."""
    import asyncio

    from tessera.config import SamplingParams
    from tessera.rpc.client import GrpcWorkerClient
    from tessera.worker_api import GenerateInput, Unavailable

    sessions = []

    class Hung(worker_pb2_grpc.WorkerServicer):
        async def Session(self, request_iterator, context):
            sessions.append(context)
            async for _ in request_iterator:
                pass
            yield worker_pb2.SessionResponse()

    async def run():
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(Hung(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = GrpcWorkerClient(f"127.0.0.1:{port}", idle_timeout_s=1.0)

        async def one(rid):
            req = GenerateInput(request_id=rid, sampling=SamplingParams(max_tokens=3), token_ids=(1,))
            try:
                return [c async for c in client.generate(req)]
            except Unavailable as e:
                return str(e)
        try:
            first = await asyncio.gather(*(one(f"r{i}") for i in range(3)))
            abandoned = client._session.closed
            second = await one("next")
            return first, abandoned, second, len(sessions)
        finally:
            await client.close()
            await server.stop(None)
    first, abandoned, second, opened = asyncio.run(asyncio.wait_for(run(), 30))
    assert all("sent nothing" in r for r in first) and "sent nothing" in second
    assert abandoned and opened == 2


def _greedy_tokens(client, rid: str):
    """The gateway client's tokens for one small greedy generation."""
    from tessera.config import SamplingParams
    from tessera.worker_api import GenerateInput
    req = GenerateInput(request_id=rid, sampling=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                        token_ids=(5, 6, 7))

    async def run():
        return [t for c in [c async for c in client.generate(req)] for t in c.token_ids]
    return run()


def test_a_gateway_client_serves_from_a_second_event_loop(worker_address):
    """grpc.aio binds a channel to the event loop that made it: the same client used again
    under another loop (asyncio.run twice) opens a channel and a session of its own there."""
    import asyncio

    from tessera.rpc.client import GrpcWorkerClient
    client = GrpcWorkerClient(worker_address)
    first = asyncio.run(asyncio.wait_for(_greedy_tokens(client, "loop-1"), 30))
    second = asyncio.run(asyncio.wait_for(_greedy_tokens(client, "loop-2"), 30))
    asyncio.run(client.close())
    assert len(first) == 4 and second == first


def test_an_idle_session_lives_through_keepalive_pings(worker_address, monkeypatch):
    """The gateway pings its idle session (rpc/options.py: keepalive), here every 100 ms for 5 s
    on a session carrying nothing: the worker takes the pings and the session goes on, while a
    server that polices pings (one per 5 minutes, one strike) closes it, so the pings are sent."""
    import asyncio

    from tessera.entrypoints.worker import WorkerServicer
    from tessera.rpc import options
    from tessera.rpc.client import GrpcWorkerClient
    from tessera.worker_api import GenerateChunk, Unavailable
    monkeypatch.setattr(options, "KEEPALIVE_TIME_MS", 100)

    class Engine:
        async def generate(self, req):
            yield GenerateChunk("x", (5, 6, 7, 8), finish_reason="length", completion_tokens=4)

    async def idle_session(address: str, idle_s: float):
        client = GrpcWorkerClient(address)
        try:
            first = await _greedy_tokens(client, "before-idle")
            session = client._session
            await asyncio.sleep(idle_s)
            open_after_idle = not session.closed
            try:
                second = await _greedy_tokens(client, "after-idle")
            except Unavailable as e:      # the policing server's GOAWAY, until the channel reconnects
                second = str(e)
            return first, second, open_after_idle, client._session is session
        finally:
            await client.close()

    async def strict():
        server = grpc.aio.server(options=[("grpc.http2.min_recv_ping_interval_without_data_ms", 300_000),
                                          ("grpc.http2.max_ping_strikes", 1)])
        worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(Engine()), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return await idle_session(f"127.0.0.1:{port}", 5.0)    # closed after ~3 s here
        finally:
            await server.stop(None)
    first, second, open_after_idle, same = asyncio.run(asyncio.wait_for(idle_session(worker_address, 5.0), 30))
    assert len(first) == 4 and second == first and open_after_idle and same
    _, _, policed_open, policed_same = asyncio.run(asyncio.wait_for(strict(), 30))
    assert not policed_open and not policed_same, (policed_open, policed_same)
