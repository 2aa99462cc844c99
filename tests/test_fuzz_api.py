"""Fuzz the HTTP API (hypothesis): in process against the twin worker, and against the real
gateway and worker processes of `tessera serve`. Arbitrary JSON, raw bytes, and request-shaped
bodies with hostile values (negative, huge, wrong types, unknown token ids, stop_token_ids,
logit_bias, long prompt lists, odd Unicode, lone surrogates, NaN) never get a 500; 503 only as
back-pressure with Retry-After; every refusal is OpenAI error JSON; requests running alongside
the fuzzer all succeed, and the server answers a normal request afterwards."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessera.async_engine import AsyncEngine
from tessera.config import CacheConfig, EngineConfig, SchedulerConfig
from tessera.engine import Engine
from tessera.entrypoints.gateway.app import create_app
from tessera.local_client import LocalWorkerClient

PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/responses"]
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow])


@pytest.fixture(scope="module")
def app(tiny_models):
    cfg = EngineConfig(model=tiny_models["llama"], dtype="float32", max_model_len=96,
                       cache=CacheConfig(block_size=4, num_blocks=256),
                       scheduler=SchedulerConfig(max_num_seqs=8, max_waiting=64))
    engine = AsyncEngine(Engine(cfg))
    yield create_app(LocalWorkerClient(engine), "tiny")
    engine.shutdown()


def send(app, path: str, content: bytes) -> httpx.Response:
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw",
                                     timeout=60) as c:
            r = await c.post(path, content=content, headers={"content-type": "application/json"})
            await r.aread()
            return r
    return asyncio.run(main())


def check(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["type"]
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12)
wild = st.one_of(st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
                 st.text(max_size=30), st.none(), st.booleans(), st.lists(st.integers(-5, 10**6), max_size=5))
small_or_wild = st.one_of(st.integers(-3, 8), wild)
# lone UTF-16 surrogates (JSON "\ud800"), and digits that only str.isdigit() takes
odd = st.sampled_from(["a\ud800b", "\udfff", "\u00b2", "\u0661\u0662", "1_0", "9" * 5000])
text = st.one_of(st.text(alphabet=st.characters(codec="utf-8"), max_size=40), odd)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "x"]),
                                           "content": st.one_of(text, wild)}), max_size=3)
optional = {"max_tokens": small_or_wild, "temperature": small_or_wild, "top_p": small_or_wild,
            "top_k": small_or_wild, "n": st.integers(-1, 4) | wild, "stream": st.booleans() | wild,
            "stop": st.one_of(text, st.lists(text, max_size=5), wild), "seed": small_or_wild,
            "logprobs": st.one_of(st.booleans(), st.integers(-1, 25), wild), "top_logprobs": small_or_wild,
            "presence_penalty": small_or_wild, "frequency_penalty": small_or_wild,
            "logit_bias": st.dictionaries(st.text(max_size=6), wild, max_size=3), "echo": st.booleans() | wild,
            "stream_options": st.one_of(st.none(), st.fixed_dictionaries({"include_usage": st.booleans() | wild})),
            "min_tokens": small_or_wild, "ignore_eos": st.booleans(),
            "stop_token_ids": st.one_of(st.lists(st.integers(-5, 2**40), max_size=3), wild),
            "repetition_penalty": small_or_wild, "min_p": small_or_wild}
token_bias = st.dictionaries(st.integers(-3, 2**40).map(str) | odd, st.one_of(st.integers(-150, 150), wild), max_size=3)
prompts = st.one_of(text, st.lists(st.integers(-5, 2**40), max_size=6), st.lists(text, max_size=3),
                    st.lists(st.lists(st.integers(0, 60000), min_size=1, max_size=3), max_size=100), wild)
shaped = st.fixed_dictionaries(
    {"model": st.sampled_from(["tiny", "other", ""])},
    optional={"messages": messages, "prompt": prompts, **optional, "logit_bias": token_bias | optional["logit_bias"]})


@FUZZ
@given(path=st.sampled_from(PATHS), body=json_values)
def test_arbitrary_json(app, path, body):
    check(send(app, path, json.dumps(body).encode()))


@FUZZ
@given(path=st.sampled_from(PATHS), body=st.binary(max_size=64))
def test_arbitrary_bytes(app, path, body):
    check(send(app, path, body))


@settings(FUZZ, max_examples=300)
@given(path=st.sampled_from(PATHS), body=shaped)
def test_request_shaped_bodies(app, path, body):
    check(send(app, path, json.dumps(body).encode()))


def test_still_serving_after_the_fuzz(app):
    r = send(app, "/v1/completions", json.dumps({"model": "tiny", "prompt": "ok", "max_tokens": 3}).encode())
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def check_live(r: httpx.Response) -> None:
    """Against live processes, 503 is allowed as back-pressure only, with Retry-After."""
    if r.status_code == 503:
        assert r.headers.get("retry-after") and r.json()["error"]["type"], r.text[:300]
    else:
        check(r)


@pytest.mark.e2e
def test_fuzz_the_real_gateway_while_others_are_served(tiny_models):
    import threading

    from servers import tessera_serve
    with tessera_serve("--model", tiny_models["llama"], "--dtype", "float32", "--max-model-len", "96",
                       "--served-model-name", "tiny", "--max-inflight", "64") as url:
        ok = json.dumps({"model": "tiny", "prompt": "ok", "max_tokens": 4, "ignore_eos": True}).encode()
        bystanders, stop = [], threading.Event()

        def bystander() -> None:
            with httpx.Client(base_url=url, timeout=60) as c:
                while not stop.is_set():
                    r = c.post("/v1/completions", content=ok, headers={"content-type": "application/json"})
                    bystanders.append((r.status_code, r.text[:200]))
        thread = threading.Thread(target=bystander)
        thread.start()
        try:
            with httpx.Client(base_url=url, timeout=60) as c:
                @settings(FUZZ, max_examples=150)
                @given(path=st.sampled_from(PATHS), body=shaped)
                def fuzz(path, body):
                    check_live(c.post(path, content=json.dumps(body).encode(),
                                      headers={"content-type": "application/json"}))
                fuzz()
        finally:
            stop.set()
            thread.join()
        assert bystanders and all(status == 200 for status, _ in bystanders), \
            [b for b in bystanders if b[0] != 200][:3]
