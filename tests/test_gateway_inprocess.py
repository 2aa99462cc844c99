"""The gateway with its in-process twin worker (LocalWorkerClient) and with an unreachable
gRPC worker: saturation and outages answer 503 with Retry-After, never a 500 or a hang."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from tessera.async_engine import AsyncEngine
from tessera.config import CacheConfig, EngineConfig, SchedulerConfig
from tessera.engine import Engine
from tessera.entrypoints.gateway.app import create_app
from tessera.local_client import LocalWorkerClient
from tessera.rpc.client import GrpcWorkerClient
from servers import free_port


@pytest.fixture(scope="module")
def tiny_engine(tiny_models):
    cfg = EngineConfig(model=tiny_models["llama"], dtype="float32", cache=CacheConfig(block_size=4, num_blocks=128),
                       scheduler=SchedulerConfig(max_num_seqs=1, max_waiting=1))
    engine = AsyncEngine(Engine(cfg))
    yield engine
    engine.shutdown()


def asgi(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=60)


def test_saturated_worker_answers_503_with_retry_after(tiny_engine):
    app = create_app(LocalWorkerClient(tiny_engine), "tiny")
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True}

    async def main():
        async with asgi(app) as c:
            results = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(4)))
            return [(r.status_code, r.headers.get("retry-after"), r.json()) for r in results]

    results = asyncio.run(main())
    statuses = sorted(s for s, _, _ in results)
    assert statuses[0] == 200 and 503 in statuses and set(statuses) <= {200, 503}
    for status, retry, body in results:
        if status == 503:
            assert retry == "1" and body["error"]["type"] == "service_unavailable"
        else:
            assert body["choices"][0]["finish_reason"] == "length"
    assert tiny_engine.engine.kv.num_free_blocks == tiny_engine.engine.kv.num_blocks


def test_unreachable_worker_is_503_not_500():
    app = create_app(GrpcWorkerClient(f"127.0.0.1:{free_port()}", idle_timeout_s=5), "m")

    async def main():
        async with asgi(app) as c:
            chat = await c.post("/v1/chat/completions",
                                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            stream = await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "stream": True})
            health = await c.get("/health")
            metrics = await c.get("/metrics")
            return chat, stream, health, metrics

    chat, stream, health, metrics = asyncio.run(main())
    for r in (chat, stream):
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert health.status_code == 503 and metrics.status_code == 200


def test_worker_killed_mid_stream_ends_with_error_event(tiny_models):
    import signal

    from servers import tessera_worker

    with tessera_worker("--model", tiny_models["llama"]) as (address, worker):
        app = create_app(GrpcWorkerClient(address, idle_timeout_s=30), "tiny")
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1500, "ignore_eos": True, "stream": True}

        async def main():
            async with asgi(app) as c:
                async def kill_soon():
                    await asyncio.sleep(1.0)
                    worker.send_signal(signal.SIGKILL)
                killer = asyncio.create_task(kill_soon())
                r = await asyncio.wait_for(c.post("/v1/completions", json=body), timeout=30)
                await killer
                return r

        r = asyncio.run(main())
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert '"error"' in events[-2] and "unavailable" in events[-2].lower()


def test_failed_engine_step_fails_its_requests_and_the_worker_keeps_serving(tiny_models):
    """A step that raises (not a lost peer) is an internal error for its requests: 500, never
    a failover that could replay a poison request on the next replica."""
    from tessera.worker_api import GenerateInput, InternalError
    from tessera.config import SamplingParams
    cfg = EngineConfig(model=tiny_models["llama"], dtype="float32", cache=CacheConfig(block_size=4, num_blocks=64))
    engine = AsyncEngine(Engine(cfg))
    real_execute = engine.engine.runner.execute
    calls = {"n": 0}

    def flaky(plan):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected expert-node failure")
        return real_execute(plan)

    engine.engine.runner.execute = flaky
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def run(rid):
        tokens = []
        async for chunk in engine.generate(GenerateInput(rid, sp, token_ids=(3, 4, 5))):
            tokens.extend(chunk.token_ids)
        return tokens

    try:
        with pytest.raises(InternalError, match="injected"):
            asyncio.run(asyncio.wait_for(run("first"), 30))
        assert engine.alive and engine.engine.kv.num_free_blocks == engine.engine.kv.num_blocks
        assert len(asyncio.run(asyncio.wait_for(run("second"), 30))) == 8
    finally:
        engine.shutdown()
