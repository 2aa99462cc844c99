"""A worker that refuses the gateway (UNAUTHENTICATED: credentials it does not take;
PERMISSION_DENIED: the gateway's role may not call it (mtls/names.py); FAILED_PRECONDITION,
UNIMPLEMENTED: another configuration error) is logged and taken out of rotation: users' requests go to a healthy
replica and succeed; with no healthy replica left they get a 503 with Retry-After, never a 500."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging

import grpc
import httpx
import pytest
from openai import APIStatusError, AsyncOpenAI

from servers import Logged, free_port, tessera_worker, wait_until
from tessera.async_engine import AsyncEngine
from tessera.config import CacheConfig, EngineConfig
from tessera.engine import Engine
from tessera.entrypoints.gateway.app import create_app
from tessera.local_client import LocalWorkerClient
from tessera.rpc.client import GrpcWorkerClient
from tessera.rpc.v1 import worker_pb2_grpc
from tessera.worker_pool import WorkerPool

CHAT = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 8, "temperature": 0}


class Refuses(worker_pb2_grpc.WorkerServicer):
    """Every call of the Worker service ends with `code` before the worker reads a request."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details

    def Generate(self, request, context):
        context.abort(self.code, self.details)

    def Session(self, request_iterator, context):
        context.abort(self.code, self.details)

    def Abort(self, request, context):
        context.abort(self.code, self.details)

    def Info(self, request, context):
        context.abort(self.code, self.details)


@contextlib.contextmanager
def refusing_worker(code=grpc.StatusCode.UNAUTHENTICATED, details="credentials refused"):
    """A gRPC server on a free loopback port answering every Worker call with `code`."""
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
    worker_pb2_grpc.add_WorkerServicer_to_server(Refuses(code, details), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


async def _chats(url: str, n: int) -> list:
    """n chat requests at once (so the pool spreads them over both workers): each response or error."""
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    calls = [client.chat.completions.create(model="tiny", **CHAT) for _ in range(n)]
    try:
        return await asyncio.gather(*calls, return_exceptions=True)
    finally:
        await client.close()


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/health/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.e2e
def test_a_refusing_worker_is_taken_out_and_requests_succeed(tiny_models):
    """`tessera gateway --worker GOOD --worker BAD` (BAD: a stale server answering UNAUTHENTICATED):
    every chat request succeeds, and the gateway's log names BAD as taken out of rotation; once
    GOOD is gone as well, a request gets a 503 with Retry-After."""
    with contextlib.ExitStack() as stack:
        bad = stack.enter_context(refusing_worker())
        good, worker = stack.enter_context(tessera_worker("--model", tiny_models["llama"], "--dtype", "float32",
                                                          "--threads", "1"))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        gateway = Logged("gateway", "--port", str(port), "--worker", good, "--worker", bad,
                         "--served-model-name", "tiny")
        stack.callback(gateway.close)
        wait_until(lambda: _ready(url), 120, "the gateway did not become ready")
        for _ in range(3):
            results = asyncio.run(_chats(url, 4))
            assert all(not isinstance(r, Exception) for r in results), results
            assert all(r.choices[0].message.content for r in results)
        gateway.wait_for(rf"worker {bad} out of rotation .*refuses this gateway \(UNAUTHENTICATED", timeout_s=10)

        worker.terminate()
        worker.wait(timeout=30)
        failed, = asyncio.run(_chats(url, 1))
        assert isinstance(failed, APIStatusError), failed
        assert failed.status_code == 503 and failed.response.headers["retry-after"] == "1"
        assert failed.response.json()["error"]["message"]


@pytest.fixture(scope="module")
def local_worker(tiny_models):
    cfg = EngineConfig(model=tiny_models["llama"], dtype="float32", cache=CacheConfig(block_size=4, num_blocks=64))
    engine = AsyncEngine(Engine(cfg))
    yield engine
    engine.shutdown()


REFUSALS = [(grpc.StatusCode.UNAUTHENTICATED, "credentials refused"),
            (grpc.StatusCode.PERMISSION_DENIED, "gateway may not call /tessera.rpc.v1.Worker/Session"),
            (grpc.StatusCode.FAILED_PRECONDITION, "this worker belongs to another deployment"),
            (grpc.StatusCode.UNIMPLEMENTED, "Method not found!")]


@pytest.mark.parametrize("code, details", REFUSALS, ids=[c.name for c, _ in REFUSALS])
def test_each_configuration_error_is_a_503_and_the_replica_goes_on(local_worker, caplog, code, details):
    """The gateway's pool over a refusing worker (real gRPC) and a healthy in-process one: the
    requests sent to the refusing one complete on the other; with only the refusing one, 503
    with Retry-After."""
    with refusing_worker(code, details) as bad:
        def client(address: str):
            return GrpcWorkerClient(address) if address == bad else LocalWorkerClient(local_worker)
        both = WorkerPool(client, [bad, "good"])
        alone = WorkerPool(client, [bad])

        async def ask(pool: WorkerPool, n: int) -> list[httpx.Response]:
            app = create_app(pool, "tiny")
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
                calls = [c.post("/v1/chat/completions", json=dict(CHAT, model="tiny")) for _ in range(n)]
                return await asyncio.wait_for(asyncio.gather(*calls), 60)
        with caplog.at_level(logging.ERROR, logger="tessera.pool"):
            served = asyncio.run(ask(both, 3))
            refused, = asyncio.run(ask(alone, 1))
    assert [r.status_code for r in served] == [200] * 3, [r.text for r in served]
    assert both.routed[bad] >= 1 and both.routed["good"] == 3      # each refused attempt went on there
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
    assert refused.json()["error"]["type"]
    taken_out = [r.getMessage() for r in caplog.records if "out of rotation" in r.getMessage()]
    assert len(taken_out) == both.routed[bad] + 1, taken_out
    assert all(code.name in m and bad in m for m in taken_out), taken_out
