"""One request never fails another or takes a worker out of service: everything that could
raise inside a batch is refused at admission with 400 and the field's name (the gateway checks
what it can alone, the worker checks token ids against the vocabulary); a request that still
breaks the sampler fails alone; a failed step is a 500 for its requests, never a failover.
Also: logit_bias, the fan-out cap, unique internal request ids, and max_tokens left unset."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from tessera.async_engine import AsyncEngine
from tessera.config import CacheConfig, EngineConfig, SchedulerConfig
from tessera.engine import Engine
from tessera.entrypoints.gateway.admission import Admission, AdmissionConfig
from tessera.entrypoints.gateway.app import create_app
from tessera.local_client import LocalWorkerClient
from tessera.worker_pool import WorkerPool

VOCAB = 49152
OK = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 24, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def engines(tiny_models):
    cfg = EngineConfig(model=tiny_models["llama"], dtype="float32", cache=CacheConfig(block_size=4, num_blocks=64),
                       scheduler=SchedulerConfig(max_num_seqs=8, max_waiting=64))
    engines = [AsyncEngine(Engine(cfg)) for _ in range(2)]
    yield engines
    for e in engines:
        e.shutdown()


def pool_app(engines, **admission):
    pool = WorkerPool(lambda a: LocalWorkerClient(engines[int(a)]), ["0", "1"])
    return pool, create_app(pool, "tiny", admission=Admission(AdmissionConfig(**admission)))


def send(app, *requests):
    """(path, json body, headers) requests sent concurrently; their responses."""
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw",
                                     timeout=60) as c:
            return await asyncio.gather(*(c.post(p, json=b, headers=h or {}) for p, b, h in requests))
    return asyncio.run(main())


HOSTILE = [   # (fields added to a valid completion request, the param the 400 names)
    ({"min_tokens": 1, "stop_token_ids": [100000000]}, "stop_token_ids"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"stop_token_ids": [2**40]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logit_bias": {str(VOCAB + 5): 3}}, "logit_bias"),
    ({"logit_bias": {"12": 101}}, "logit_bias"),
    ({"logit_bias": {"twelve": 1}}, "logit_bias"),
    ({"seed": 2**70}, "seed"),
    ({"top_k": 2**40}, "top_k"),
    ({"max_tokens": 2**40}, "max_tokens"),
    ({"min_tokens": 2**40}, "min_tokens"),
    ({"prompt": [2**40]}, "prompt"),
    ({"prompt": [[5, 6], [VOCAB]]}, "prompt"),
    ({"prompt": [VOCAB + 1]}, "prompt"),
]


def test_hostile_requests_are_400_and_hurt_nobody_else(engines):
    pool, app = pool_app(engines)
    requests = [("/v1/completions", OK, None)] * 4 + \
        [("/v1/completions", dict(OK, **extra), None) for extra, _ in HOSTILE] + [("/v1/completions", OK, None)] * 4
    responses = send(app, *requests)
    good = [r for r in responses[:4] + responses[-4:]]
    assert all(r.status_code == 200 for r in good), [r.text for r in good if r.status_code != 200]
    assert len({r.json()["choices"][0]["text"] for r in good}) == 1
    for r, (extra, param) in zip(responses[4:-4], HOSTILE):
        assert r.status_code == 400, (extra, r.status_code, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.json())
    assert pool.failovers == 0 and not pool.down_until
    for e in engines:
        assert e.alive and e.engine.kv.num_free_blocks == e.engine.kv.num_blocks


def test_a_row_that_breaks_the_sampler_fails_alone(engines, monkeypatch):
    """Validation should make it unreachable; if a row still raises, the batch's others go on."""
    import tessera.engine as engine_module
    real = engine_module.sample

    def fragile(logits, batch, generator=None):
        if any(p.top_k == 7 for p in batch.params):
            raise IndexError("injected sampler bug")
        return real(logits, batch, generator)
    monkeypatch.setattr(engine_module, "sample", fragile)
    pool, app = pool_app(engines)
    responses = send(app, *[("/v1/completions", OK, None)] * 3,
                     ("/v1/completions", dict(OK, top_k=7, temperature=1.0), None))
    assert [r.status_code for r in responses] == [200, 200, 200, 500]
    assert responses[-1].json()["error"]["code"] == "internal_error"
    assert pool.failovers == 0 and not pool.down_until


def test_logit_bias_forces_a_token(engines):
    _, app = pool_app(engines)
    forced, = send(app, ("/v1/completions", dict(OK, max_tokens=5, logit_bias={"1234": 100}), None))
    body = forced.json()
    assert forced.status_code == 200, forced.text
    assert body["usage"]["completion_tokens"] == 5
    assert body["choices"][0]["text"] == engines[0].engine.tokenizer.decode([1234] * 5)


def test_fan_out_is_capped_and_each_choice_counts_in_flight(engines):
    _, app = pool_app(engines, max_choices=8, max_inflight=6)
    many, wide, fits, too_wide = send(
        app, ("/v1/completions", dict(OK, prompt=[[5, 6]] * 9), None),
        ("/v1/completions", dict(OK, n=9), None),
        ("/v1/completions", dict(OK, prompt=[[5, 6], [7, 8]], n=3), None),
        ("/v1/completions", dict(OK, prompt=[[5, 6], [7, 8]], n=4), None))
    assert many.status_code == 400 and many.json()["error"]["param"] == "prompt"
    assert wide.status_code == 400 and wide.json()["error"]["param"] == "n"
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 6
    assert too_wide.status_code == 503 and too_wide.headers["retry-after"] == "1"


def test_same_client_request_id_never_collides(engines):
    _, app = pool_app(engines)
    headers = {"X-Request-Id": "dup-id"}
    responses = send(app, *[("/v1/completions", OK, headers)] * 3,
                     *[("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 4}, headers)] * 2)
    assert [r.status_code for r in responses] == [200] * 5
    assert all(r.headers["x-request-id"] == "dup-id" for r in responses)
    assert len({r.json()["id"] for r in responses}) == 5


def test_unset_max_tokens_runs_to_what_the_cache_holds(tiny_models):
    """KV cache of 16 x 4 = 64 tokens, context 2048: the request runs to 64 tokens and ends with
    finish_reason "length" (vLLM's rule), instead of being refused."""
    cfg = EngineConfig(model=tiny_models["llama"], dtype="float32", cache=CacheConfig(block_size=4, num_blocks=16))
    engine = AsyncEngine(Engine(cfg))
    try:
        app = create_app(LocalWorkerClient(engine), "tiny")
        body = {"model": "tiny", "prompt": [5, 6, 7], "ignore_eos": True, "max_tokens": None}
        r, = send(app, ("/v1/completions", body, None))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == 64 - 3
        too_long, = send(app, ("/v1/completions", dict(body, prompt=[5] * 64), None))
        assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    finally:
        engine.shutdown()


def test_a_slow_consumer_gets_several_steps_in_one_chunk(tiny_models):
    """A stream read slower than the engine steps (a client or gateway behind under load)
    gets the outputs waiting for it merged: fewer chunks than tokens, the same tokens, text
    and logprobs in order as a stream read at once, and the last chunk finishes it."""
    from tessera.config import SamplingParams
    from tessera.worker_api import GenerateInput
    cfg = EngineConfig(model=tiny_models["llama"], dtype="float32", cache=CacheConfig(block_size=4, num_blocks=64))
    engine = AsyncEngine(Engine(cfg))
    sampling = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)

    async def read(rid: str, pause_s: float) -> list:
        chunks = []
        async for chunk in engine.generate(GenerateInput(rid, sampling, token_ids=(5, 6, 7))):
            chunks.append(chunk)
            await asyncio.sleep(pause_s)
        return chunks
    try:
        fast = asyncio.run(read("fast", 0.0))
        slow = asyncio.run(read("slow", 0.05))
    finally:
        engine.shutdown()
    tokens = lambda cs: [t for c in cs for t in c.token_ids]  # noqa: E731
    assert len(tokens(fast)) == len(tokens(slow)) == 24
    assert tokens(slow) == tokens(fast)
    assert "".join(c.text for c in slow) == "".join(c.text for c in fast)
    assert [lp.token_id for c in slow for lp in c.logprobs] == tokens(fast)
    assert len(slow) < 24 and slow[-1].finish_reason == "length" and slow[-1].completion_tokens == 24
