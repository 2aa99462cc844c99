"""Admission at the gateway, in process with the twin worker and a real Redis: body size (413),
API keys stored hashed (401), per-key requests/tokens per minute counted in Redis (429 with
Retry-After), the in-flight bound (503 with Retry-After), readiness vs liveness, and the
OpenAI error JSON on every refusal."""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

import httpx
import pytest

from tessera.async_engine import AsyncEngine
from tessera.config import CacheConfig, EngineConfig, SchedulerConfig
from tessera.engine import Engine
from tessera.entrypoints.gateway.admission import Admission, AdmissionConfig, digest
from tessera.entrypoints.gateway.app import create_app
from tessera.local_client import LocalWorkerClient
from tessera.rpc.client import GrpcWorkerClient
from servers import free_port, redis_url

BODY = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_models):
    cfg = EngineConfig(model=tiny_models["llama"], dtype="float32", cache=CacheConfig(block_size=4, num_blocks=256),
                       scheduler=SchedulerConfig(max_num_seqs=8, max_waiting=64))
    engine = AsyncEngine(Engine(cfg))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def redis():
    with redis_url() as url:
        yield url


def run(app, *requests):
    """Send (method, path, kwargs) requests concurrently through the app; return the responses."""
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw",
                                     timeout=60) as c:
            return await asyncio.gather(*(c.request(m, p, **kw) for m, p, kw in requests))
    return asyncio.run(main())


def assert_error(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["message"]


def test_body_larger_than_limit_is_413(engine):
    app = create_app(LocalWorkerClient(engine), "tiny", admission=Admission(AdmissionConfig(max_body_bytes=2048)))
    big = dict(BODY, prompt="x" * 4096)

    async def chunked():   # no Content-Length: counted while it arrives
        yield b'{"model": "tiny", "prompt": "'
        yield b"y" * 4096 + b'"}'
    small, declared, streamed = run(app, ("POST", "/v1/completions", {"json": BODY}),
                                    ("POST", "/v1/completions", {"json": big}),
                                    ("POST", "/v1/completions", {"content": chunked(),
                                                                 "headers": {"content-type": "application/json"}}))
    assert small.status_code == 200
    assert_error(declared, 413, "request_too_large")
    assert_error(streamed, 413, "request_too_large")


def test_api_keys_are_checked_against_hashes(engine):
    config = AdmissionConfig(require_key=True, key_digests=(digest("sk-good"),))
    app = create_app(LocalWorkerClient(engine), "tiny", admission=Admission(config))
    assert "sk-good" not in repr(config)
    ok, missing, wrong, models = run(
        app, ("POST", "/v1/completions", {"json": BODY, "headers": {"Authorization": "Bearer sk-good"}}),
        ("POST", "/v1/completions", {"json": BODY}),
        ("POST", "/v1/completions", {"json": BODY, "headers": {"Authorization": "Bearer sk-bad"}}),
        ("GET", "/health/live", {}))
    assert ok.status_code == 200 and models.status_code == 200
    assert_error(missing, 401, "invalid_api_key")
    assert_error(wrong, 401, "invalid_api_key")


def clear_of_a_minute_boundary(seconds: float) -> None:
    """Wait, if needed, until the next clock minute is at least `seconds` away."""
    left = 60 - time.time() % 60
    if left < seconds:
        time.sleep(left + 0.1)


def test_per_key_request_and_token_limits_in_redis(engine, redis):
    prefix = f"test-limits-{uuid.uuid4().hex[:8]}"

    async def make_keys():
        admission = Admission(AdmissionConfig(), redis, prefix)
        try:
            return await admission.add_key("few-requests", rpm=3), await admission.add_key("few-tokens", tpm=10)
        finally:
            await admission.close()
    few_requests, few_tokens = asyncio.run(make_keys())

    def app():   # a fresh gateway each time: the counters live in Redis, not in the process
        return create_app(LocalWorkerClient(engine), "tiny",
                          admission=Admission(AdmissionConfig(require_key=True, keys_from_redis=True), redis, prefix))

    auth = {"Authorization": f"Bearer {few_requests}"}
    clear_of_a_minute_boundary(15)   # the limits count per clock minute: no reset mid-burst
    responses = run(app(), *[("POST", "/v1/completions", {"json": BODY, "headers": auth})] * 5)
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200, 200, 200, 429, 429]
    limited = next(r for r in responses if r.status_code == 429)
    assert_error(limited, 429, "rate_limit_exceeded")
    assert 1 <= int(limited.headers["retry-after"]) <= 60
    assert run(app(), ("POST", "/v1/completions", {"json": BODY, "headers": auth}))[0].status_code == 429

    # 3 prompt + 4 completion tokens per request: the second request is admitted (7 < 10),
    # after which the key's minute holds 14 tokens and the third is refused.
    auth = {"Authorization": f"Bearer {few_tokens}"}
    gateway = app()
    first, second = (run(gateway, ("POST", "/v1/completions", {"json": BODY, "headers": auth}))[0]
                     for _ in range(2))
    assert first.status_code == 200 and second.status_code == 200
    third = _eventually_429(gateway, auth)
    assert "tokens per minute" in third.json()["error"]["message"]


def test_limits_count_per_key_not_per_name_and_a_stored_zero_is_unlimited(engine, redis):
    """Two keys may carry one name: each has its own budget. A key stored with rpm 0 is
    unlimited even where the gateway's default (--rpm) is not; one stored without a limit
    gets that default."""
    prefix = f"test-ids-{uuid.uuid4().hex[:8]}"

    async def make_keys():
        admission = Admission(AdmissionConfig(), redis, prefix)
        try:
            return [await admission.add_key(*args) for args in
                    (("twin", 2), ("twin", 2), ("unlimited", 0, 0), ("default",))]
        finally:
            await admission.close()
    first, second, unlimited, default = asyncio.run(make_keys())
    app = create_app(LocalWorkerClient(engine), "tiny", admission=Admission(
        AdmissionConfig(require_key=True, keys_from_redis=True, rpm=1), redis, prefix))

    async def statuses(*keys: str) -> list[int]:     # one event loop: the app's Redis client lives in it
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=60) as c:
            return [(await c.post("/v1/completions", json=BODY, headers={"Authorization": f"Bearer {k}"})).status_code
                    for k in keys]
    clear_of_a_minute_boundary(15)
    assert asyncio.run(statuses(*[first] * 3, *[second] * 3, *[unlimited] * 3, *[default] * 2)) == [
        200, 200, 429, 200, 200, 429, 200, 200, 200, 200, 429]


def _eventually_429(app, auth) -> httpx.Response:
    """Tokens are charged just after a request ends (a task on the app's loop): allow that."""
    for _ in range(20):
        r = run(app, ("POST", "/v1/completions", {"json": BODY, "headers": auth}))[0]
        if r.status_code == 429:
            return r
    raise AssertionError("the token limit never applied")


def test_in_flight_bound_answers_503_with_retry_after(engine):
    app = create_app(LocalWorkerClient(engine), "tiny", admission=Admission(AdmissionConfig(max_inflight=2)))
    long = dict(BODY, max_tokens=64)
    responses = run(app, *[("POST", "/v1/completions", {"json": long})] * 6)
    statuses = sorted(r.status_code for r in responses)
    assert statuses.count(200) >= 2 and set(statuses) <= {200, 503}
    refused = [r for r in responses if r.status_code == 503]
    assert refused and all(r.headers["retry-after"] == "1" for r in refused)
    assert_error(refused[0], 503, "server_overloaded")
    metrics = run(app, ("GET", "/metrics", {}))[0].text
    assert 'tessera_gateway_requests_inflight{model_name="tiny"} 0.0' in metrics
    assert f'tessera_gateway_rejected_requests{{model_name="tiny",status="503"}} {len(refused)}.0' in metrics


def test_liveness_does_not_need_a_worker_but_readiness_does():
    app = create_app(GrpcWorkerClient(f"127.0.0.1:{free_port()}"), "tiny")
    live, ready = run(app, ("GET", "/health/live", {}), ("GET", "/health/ready", {}))
    assert live.status_code == 200
    assert ready.status_code == 503 and ready.json()["status"] == "not ready"


def test_worker_serves_its_own_prometheus_metrics(engine):
    from tessera.metrics import serve_worker_metrics
    port = free_port()
    serve_worker_metrics(engine, "worker", port)
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_ratio", "kv_cache_free_blocks"):
        assert f'tessera_worker_{name}{{model_name="' in text, name


def test_authentication_comes_before_validation_and_model_lookup(engine):
    """Without a key a caller learns nothing: a bad body or unknown model is 401, not 400/404;
    /health (it runs an engine step) needs the key too; /health/live stays open."""
    config = AdmissionConfig(require_key=True, key_digests=(digest("sk-good"),))
    app = create_app(LocalWorkerClient(engine), "tiny", admission=Admission(config))
    good = {"Authorization": "Bearer sk-good"}
    bad_body, other_model, health, live, health_ok, bad_with_key = run(
        app, ("POST", "/v1/completions", {"json": {"model": "tiny", "prompt": [1], "top_p": "x"}}),
        ("POST", "/v1/completions", {"json": dict(BODY, model="nope")}),
        ("GET", "/health", {}), ("GET", "/health/live", {}), ("GET", "/health", {"headers": good}),
        ("POST", "/v1/completions", {"json": {"model": "tiny", "prompt": [1], "top_p": "x"}, "headers": good}))
    for r in (bad_body, other_model, health):
        assert_error(r, 401, "invalid_api_key")
    assert live.status_code == 200 and health_ok.status_code == 200
    assert bad_with_key.status_code == 400


def test_unknown_keys_are_bounded_and_repeated_failures_are_429(engine, redis):
    config = AdmissionConfig(require_key=True, keys_from_redis=True, key_cache_size=8, auth_failures_per_min=5,
                             trusted_proxies=("127.0.0.1",))
    admission = Admission(config, redis, f"test-neg-{uuid.uuid4().hex[:8]}")
    app = create_app(LocalWorkerClient(engine), "tiny", admission=admission)
    responses = run(app, *[("POST", "/v1/completions",
                            {"json": BODY, "headers": {"Authorization": f"Bearer sk-{i}",
                                                       "X-Forwarded-For": f"10.0.0.{i % 3}"}})
                           for i in range(30)])
    assert {r.status_code for r in responses} == {401}   # 3 forwarded addresses x 10 tries, not trusted
    assert len(admission._keys) <= 8
    # the ASGI test client's peer is not 127.0.0.1, so X-Forwarded-For is ignored: one address
    strict = Admission(dataclasses.replace(config, trusted_proxies=()), redis, "x")
    app = create_app(LocalWorkerClient(engine), "tiny", admission=strict)
    statuses = [r.status_code for _ in range(8) for r in run(
        app, ("POST", "/v1/completions", {"json": BODY, "headers": {"Authorization": "Bearer sk-x"}}))]
    assert statuses.count(401) == 5 and statuses.count(429) == 3
    assert Admission(config).client_address("127.0.0.1", "203.0.113.9, 10.1.1.1") == "203.0.113.9"
    assert Admission(config).client_address("192.0.2.1", "203.0.113.9") == "192.0.2.1"
