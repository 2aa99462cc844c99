"""`tessera up` and `tessera serve` survive the death of one process, through the commands a
user runs and the official openai client: a worker SIGKILLed with 6 streams in flight is
restarted and registers again while every stream completes on the other replica (a killed
Redis comes back on its port too); SIGTERM lets the stream in flight finish, then `up` exits 0;
`serve` restarts its worker and keeps its gateway."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
import yaml

from servers import Logged, free_port, free_port_range, wait_until

pytestmark = pytest.mark.e2e
GRACE_S = 20
TOKENS = 256   # per stream: enough that every stream is still running when its worker is killed


async def _chat(client, model: str, i: int, max_tokens: int, first: asyncio.Event | None = None):
    """One streamed chat: (text, finish_reason, completion tokens)."""
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Count slowly from {i} upwards."}], stream=True,
        max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True})
    text, finish, tokens = "", None, 0
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if not chunk.choices:
            continue
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        if first is not None:
            first.set()
    return text, finish, tokens


def _openai(url: str):
    from openai import AsyncOpenAI
    return AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/health/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _gateway_workers(url: str) -> float:
    """The gateway's own count of workers it routes to (it polls the registry every second)."""
    lines = [line for line in httpx.get(url + "/metrics").text.splitlines()
             if line.startswith("tessera_gateway_workers{") or line.startswith("tessera_gateway_workers ")]
    return sum(float(line.split()[-1]) for line in lines)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """`tessera up deploy/topologies/single.yaml` on free ports, with its own Redis."""
    spec = yaml.safe_load(open("deploy/topologies/single.yaml"))
    worker_port = free_port_range(2)
    spec["roles"]["worker"]["port"] = worker_port
    topology = tmp_path_factory.mktemp("up") / "single.yaml"
    topology.write_text(yaml.safe_dump(spec))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    up = Logged("up", str(topology), "--port", str(port), "--restart-backoff-s", "0.2",
                "--shutdown-grace-s", str(GRACE_S), env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        for i in range(2):
            up.wait_for(rf"tessera worker ready on 127.0.0.1:{worker_port + i}", 240)
        wait_until(lambda: _ready(url), 120, "the gateway never became ready")
        yield up, url, worker_port
    finally:
        up.close()


def _registered(up: Logged, prefix: str = "tessera:single") -> list[str]:
    from tessera.registry import RedisRegistry
    redis_url = up.redis_url()

    async def addresses():
        from tessera.registry import RegistryUnavailable
        registry = RedisRegistry(redis_url, prefix=prefix)
        try:
            return sorted(r.address for r in await registry.list())
        except RegistryUnavailable:   # a restarted Redis that does not accept connections yet
            return []
        finally:
            await registry.close()
    return asyncio.run(addresses())


def test_up_restarts_a_sigkilled_worker_while_its_streams_fail_over(single):
    up, url, _ = single
    try:
        _sigkilled_worker_streams_fail_over(single)
    except (AssertionError, TimeoutError) as e:   # what up and the gateway saw, for a failure in CI
        metrics = [line for line in httpx.get(url + "/metrics").text.splitlines() if line.startswith("tessera_gateway")]
        raise AssertionError(f"{e}\n--- tessera up:\n" + "\n".join(up.lines[-80:]) +
                             "\n--- gateway metrics:\n" + "\n".join(metrics)) from e


def _sigkilled_worker_streams_fail_over(single):
    up, url, worker_port = single
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    wait_until(lambda: len(_registered(up)) == 2, 30, "both workers never registered")
    wait_until(lambda: _gateway_workers(url) == 2, 30, "the gateway never routed to both workers")  # else all
    victim = up.pid("worker-0")                                                    # streams may avoid it

    async def run():
        client = _openai(url)
        firsts = [asyncio.Event() for _ in range(6)]
        tasks = [asyncio.create_task(_chat(client, model, i, TOKENS, firsts[i])) for i in range(6)]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 60)
        assert not any(t.done() for t in tasks), "a stream ended before the kill: nothing left to fail over"
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            raise AssertionError("worker-0 died before the kill:\n" + "\n".join(up.lines[-60:])) from None
        return await asyncio.gather(*tasks)
    results = asyncio.run(run())
    assert [r[1:] for r in results] == [("length", TOKENS)] * 6 and all(r[0] for r in results)
    up.wait_for(r"worker-0 \(pid \d+\) exited with signal SIGKILL; restarting in", 10)
    assert up.pid("worker-0") != victim
    assert asyncio.run(_chat(_openai(url), model, 7, 4))[1] == "length"       # a new request succeeds
    up.wait_for(rf"tessera worker ready on 127.0.0.1:{worker_port}", 120, count=2)  # the new process serves
    wait_until(lambda: f"127.0.0.1:{worker_port}" in _registered(up), 30, "the restarted worker never registered")
    assert up.proc.poll() is None and len(up.pids("gateway-0")) == 1 and len(up.pids("worker-1")) == 1
    failovers = [line for line in httpx.get(url + "/metrics").text.splitlines()
                 if line.startswith("tessera_gateway_failovers_total")]
    assert failovers and float(failovers[0].split()[-1]) >= 1, failovers     # streams did move

    os.kill(up.pid("redis-0"), signal.SIGKILL)       # Redis comes back on its port; workers re-register
    up.wait_for(r"redis-0 pid \d+ \(restart 1\)", 10)
    wait_until(lambda: len(_registered(up)) == 2, 30, "the workers never registered in the restarted Redis")
    assert asyncio.run(_chat(_openai(url), model, 8, 4))[1] == "length"


def test_sigterm_lets_the_stream_in_flight_finish_then_up_exits_0(single):
    up, url, _ = single
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]

    async def run():
        first = asyncio.Event()
        task = asyncio.create_task(_chat(_openai(url), model, 1, 64, first))
        await asyncio.wait_for(first.wait(), 60)
        up.proc.send_signal(signal.SIGTERM)
        return await task, time.monotonic()
    t0 = time.monotonic()
    (_, finish, tokens), done = asyncio.run(run())
    assert (finish, tokens) == ("length", 64)
    assert up.proc.wait(timeout=GRACE_S + 30) == 0
    assert time.monotonic() - t0 < GRACE_S + 30
    up.wait_for("tessera up: draining", 1)
    assert not _ready(url)   # everything stopped


def test_serve_restarts_its_worker_and_keeps_its_gateway(tiny_models):
    port, worker_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    serve = Logged("serve", "--model", tiny_models["llama"], "--dtype", "float32", "--threads", "1",
                   "--port", str(port), "--worker-port", str(worker_port), "--restart-backoff-s", "0.2")
    try:
        wait_until(lambda: _ready(url), 180, "serve never became ready")
        gateway, victim = serve.pid("gateway-0"), serve.pid("worker-0")
        os.kill(victim, signal.SIGKILL)
        serve.wait_for(r"worker-0 pid \d+ \(restart 1\)", 10)
        body = {"model": "llama", "prompt": "again", "max_tokens": 4}
        wait_until(lambda: httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200, 60,
              "no request succeeded after the worker restarted")
        assert serve.pids("gateway-0") == [gateway] and serve.proc.poll() is None
    finally:
        assert serve.close() == 0
