"""Platform reliability with real processes (two registered workers on a tiny model, a gateway
following a real Redis): Redis stopped for 10 s under load fails no request and the workers
re-register when it returns; 4x overload for 20 s answers only 200/429/503 with bounded memory
and every admitted request finishes; the request id reaches the worker's JSON logs through
gRPC metadata."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

import httpx
import pytest

from servers import redis_server, tessera_gateway, tessera_grpc
from tessera.registry import RedisRegistry

pytestmark = pytest.mark.e2e


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def gauge(url: str, name: str) -> float | None:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.split()[-1])
    return None


async def registered(url: str, prefix: str) -> list[str]:
    reg = RedisRegistry(url, prefix=prefix)
    try:
        return [r.address for r in await reg.list()]
    finally:
        await reg.close()


@contextlib.contextmanager
def deployment(redis: str, model: str, worker_args=(), gateway_args=(), stderr=None):
    """Two registered workers and a gateway; yields (gateway url, gateway process, workers)."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    args = ("--model", model, "--dtype", "float32", "--threads", "1", "--registry", redis,
            "--registry-prefix", prefix, *worker_args)
    with contextlib.ExitStack() as stack:
        workers = [stack.enter_context(tessera_grpc("worker", *args, stderr=stderr)) for _ in range(2)]
        url, proc = stack.enter_context(tessera_gateway("--registry", redis, "--registry-prefix", prefix,
                                                        *gateway_args))
        deadline = time.monotonic() + 30   # until the gateway routes to both replicas
        while gauge(url, "tessera_gateway_workers") != 2:
            assert time.monotonic() < deadline, "the gateway did not discover both workers"
            time.sleep(0.5)
        yield url, proc, workers, prefix


async def load(url: str, model: str, users: int, seconds: float, max_tokens: int = 8) -> list[tuple[int, dict]]:
    """`users` clients sending completions back to back for `seconds`; every (status, body)."""
    results = []
    body = {"model": model, "prompt": "the registry says", "max_tokens": max_tokens, "ignore_eos": True}

    async def user(client: httpx.AsyncClient) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                r = await client.post("/v1/completions", json=body)
                results.append((r.status_code, r.json()))
            except httpx.HTTPError as e:
                results.append((0, {"error": repr(e)}))
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        await asyncio.gather(*(user(client) for _ in range(users)))
    return results


def test_redis_down_for_10_s_under_load_fails_nothing(tiny_models):
    with redis_server() as redis, deployment(redis.url, tiny_models["llama"]) as (url, _, workers, prefix):
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]

        async def main():
            traffic = asyncio.create_task(load(url, model, users=4, seconds=16))
            await asyncio.sleep(3)
            redis.stop()
            await asyncio.sleep(10)
            redis.start()      # empty: nothing persisted; the workers' heartbeats re-register them
            return await traffic
        results = asyncio.run(main())
        assert len(results) > 20
        failed = [r for r in results if r[0] != 200]
        assert not failed, failed[:3]
        print(f"\n[figures] Redis down 10 s under 4 users: {len(results)} requests, {len(failed)} failed")
        deadline = time.monotonic() + 5
        while sorted(asyncio.run(registered(redis.url, prefix))) != sorted(a for a, _ in workers):
            assert time.monotonic() < deadline, "workers did not re-register within 5 s of Redis returning"
            time.sleep(0.2)


def test_overload_at_4x_capacity_for_20_s(tiny_models):
    # capacity: 2 workers x (2 running + 2 queued) = 8 requests; 32 users keep 4x that in flight
    worker_args = ("--max-num-seqs", "2", "--max-waiting", "2")
    with redis_server() as redis, deployment(redis.url, tiny_models["llama"], worker_args,
                                             ("--max-inflight", "16")) as (url, gateway, workers, _):
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        pids = [gateway.pid] + [p.pid for _, p in workers]
        asyncio.run(load(url, model, users=32, seconds=3, max_tokens=16))     # warm up, then measure
        before = [rss_mb(pid) for pid in pids]
        results = asyncio.run(load(url, model, users=32, seconds=20, max_tokens=16))
        after = [rss_mb(pid) for pid in pids]
        statuses = {s for s, _ in results}
        assert statuses <= {200, 429, 503}, statuses
        assert 200 in statuses and 503 in statuses
        for status, body in results:
            if status == 200:
                assert body["choices"][0]["finish_reason"] == "length"
                assert body["usage"]["completion_tokens"] == 16
        growth = [a - b for a, b in zip(after, before)]
        counts = {s: sum(1 for x, _ in results if x == s) for s in sorted(statuses)}
        print(f"\n[figures] 4x overload 20 s: responses by status {counts}; RSS MB before {before} "
              f"after {after}")
        assert max(growth) < 150, f"RSS grew by {growth} MB"
        metrics = httpx.get(url + "/metrics").text
        assert 'tessera_gateway_requests_inflight{model_name="' in metrics
        assert httpx.post(url + "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2}
                          ).status_code == 200


def test_request_id_reaches_the_worker_logs_as_json(tiny_models, tmp_path):
    log = tmp_path / "worker.log"
    with redis_server() as redis, open(log, "w") as stderr, \
            deployment(redis.url, tiny_models["llama"], stderr=stderr) as (url, *_):
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 3},
                       headers={"X-Request-Id": "trace-me-42"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "trace-me-42"
        chat = httpx.post(url + "/v1/chat/completions", headers={"X-Request-Id": "trace-me-43"},
                          json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert chat.status_code == 200
        time.sleep(0.5)
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    mine = [line for line in lines if line.get("request_id", "").startswith("trace-me-42")]
    assert {line["msg"] for line in mine} >= {"generate", "generate done"}, lines[-5:]
    done = next(line for line in mine if line["msg"] == "generate done")
    assert done["completion_tokens"] == 3 and done["logger"] == "tessera.worker"
    assert done["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    # a chat prompt is counted once the worker has rendered and tokenized it, as the usage is
    done = next(line for line in lines if line.get("request_id", "").startswith("trace-me-43")
                and line["msg"] == "generate done")
    assert done["prompt_tokens"] == chat.json()["usage"]["prompt_tokens"] > 0
