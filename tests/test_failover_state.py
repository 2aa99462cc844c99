"""Failover continues the same generation: a request resumed on another engine with its
output so far (Resume) yields exactly the tokens, text, finish reason and usage of the same
request never interrupted — with seeded sampling, penalties, min_tokens and a stop string that
spans the cut; and the gateway's pool does it when a twin worker fails mid-stream."""
from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest

from tessera.async_engine import AsyncEngine
from tessera.config import CacheConfig, EngineConfig, SamplingParams
from tessera.engine import Engine
from tessera.entrypoints.gateway.app import create_app
from tessera.local_client import LocalWorkerClient
from tessera.request import Resume
from tessera.worker_api import Unavailable
from tessera.worker_pool import WorkerPool

SAMPLING = SamplingParams(temperature=0.8, seed=1234, frequency_penalty=0.5, presence_penalty=0.3,
                          repetition_penalty=1.1, min_tokens=5, max_tokens=40, ignore_eos=False)


def run(engine: Engine, prompt, sampling, resume=None, stop_after: int | None = None):
    """(token ids, text deltas joined, finish reason, completion tokens); with stop_after, the
    request is aborted once it has that many output tokens (a worker dying)."""
    rid = engine.add_request(prompt, sampling, resume=resume)
    tokens, text, finish, usage = [], "", None, 0
    while finish is None:
        for out in engine.step():
            if out.request_id != rid:
                continue
            tokens += out.new_token_ids
            text += out.new_text
            finish, usage = out.finish_reason, out.completion_tokens
        if stop_after is not None and len(tokens) + len(resume.output_token_ids if resume else ()) >= stop_after:
            engine.abort(rid)
            break
    return tokens, text, finish, usage


def test_resume_continues_exactly(smollm2_engine):
    e = smollm2_engine
    prompt = e.tokenizer("Write a short story about a lighthouse keeper:")["input_ids"]
    tokens, text, finish, usage = run(e, prompt, SAMPLING)
    assert len(tokens) >= 20
    # a stop string that spans the cut after 12 tokens: its first characters come before it
    cut_text = e.tokenizer.decode(tokens[:12], skip_special_tokens=True)
    stop = text[len(cut_text) - 2:len(cut_text) + 3]
    assert len(stop.strip()) >= 3, repr(stop)
    sampling = dataclasses.replace(SAMPLING, stop=(stop,))
    full = run(e, prompt, sampling)
    assert full[2] == "stop" and full[1].endswith(text[:len(cut_text) - 2][-5:])
    for cut in (1, 6, 11, 12):
        first_tokens, sent, _, _ = run(e, prompt, sampling, stop_after=cut)
        rest = run(e, prompt, sampling, resume=Resume(tuple(first_tokens), len(sent)))
        assert first_tokens + rest[0] == full[0], cut
        assert sent + rest[1] == full[1], cut
        assert rest[2:] == full[2:], cut
    assert e.kv.num_free_blocks == e.kv.num_blocks


class DiesAfter:
    """A twin worker whose process 'dies' after n chunks of every stream."""

    def __init__(self, inner: LocalWorkerClient, n: int) -> None:
        self.inner, self.n = inner, n

    async def generate(self, request):
        seen = 0
        async for chunk in self.inner.generate(request):
            if seen == self.n:
                raise Unavailable("worker process died")
            seen += 1
            yield chunk

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    async def info(self, timeout_s: float = 5.0):
        return await self.inner.info(timeout_s=timeout_s)

    async def close(self) -> None:
        return None


@pytest.fixture(scope="module")
def twins(tiny_models):
    cfg = EngineConfig(model="smollm2", dtype="float32", cache=CacheConfig(num_blocks=64))
    engines = [AsyncEngine(Engine(cfg)) for _ in range(2)]
    yield engines
    for engine in engines:
        engine.shutdown()


@pytest.mark.parametrize("stream", [False, True])
def test_gateway_failover_yields_the_same_text_and_usage(twins, stream):
    body = {"model": "m", "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "temperature": 0.8, "seed": 99, "frequency_penalty": 0.6, "presence_penalty": 0.2,
            "min_tokens": 8, "max_tokens": 48, "stop": [" the sea", "!"], "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}
    healthy = WorkerPool(lambda a: LocalWorkerClient(twins[int(a)]), ["1"])
    failing = WorkerPool(lambda a: DiesAfter(LocalWorkerClient(twins[0]), 5) if a == "0"
                         else LocalWorkerClient(twins[1]), ["0", "1"])
    failing.outstanding["1"] = 1     # route the first attempt to the dying worker

    async def ask(pool) -> tuple[str, dict]:
        app = create_app(pool, "m")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw",
                                     timeout=120) as c:
            if not stream:
                r = (await c.post("/v1/chat/completions", json=body)).json()
                assert "choices" in r, r
                return r["choices"][0]["message"]["content"], r["usage"]
            text, usage = "", None
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = httpx.Response(200, content=line[6:]).json()
                        assert "error" not in chunk, chunk
                        usage = chunk.get("usage") or usage
                        text += "".join(c["delta"].get("content", "") for c in chunk["choices"])
            return text, usage

    expected = asyncio.run(ask(healthy))
    got = asyncio.run(ask(failing))
    assert failing.failovers == 1
    # cached prompt tokens are whatever the serving worker's prefix cache held: not part of the state
    details = [usage.pop("prompt_tokens_details") for _, usage in (expected, got)]
    assert all(d["cached_tokens"] <= expected[1]["prompt_tokens"] for d in details)
    assert got == expected
    assert expected[1]["completion_tokens"] > 5
