"""A stream failed over to another worker keeps the limits its first worker resolved: the
output it already has counts toward max_tokens, not as more prompt. Near the context limit,
near the KV cache's limit and with max_tokens unset, a request whose worker dies mid-stream
ends exactly as the same request never interrupted: same text, finish_reason and usage,
through the HTTP API and the official openai client. A replica that answers Saturated when the
stream moves to it is skipped like any other: the stream goes on on the next one."""
from __future__ import annotations

import asyncio

import httpx
import pytest
from openai import AsyncOpenAI

from test_failover_state import DiesAfter
from tessera.async_engine import AsyncEngine
from tessera.config import CacheConfig, EngineConfig, SchedulerConfig
from tessera.engine import Engine
from tessera.entrypoints.gateway.app import create_app
from tessera.local_client import LocalWorkerClient
from tessera.worker_pool import WorkerPool

CONTEXT = 48          # max_model_len of both workers
KV_TOKENS = 40        # a second pair whose KV cache (10 blocks of 4) is the tighter limit
PROMPT = "the keeper of the light"


def _pair(tiny_models, num_blocks: int) -> list[AsyncEngine]:
    cfg = EngineConfig(model=tiny_models["llama"], dtype="float32", max_model_len=CONTEXT,
                       cache=CacheConfig(block_size=4, num_blocks=num_blocks))
    return [AsyncEngine(Engine(cfg)) for _ in range(2)]


@pytest.fixture(scope="module")
def context_bound(tiny_models):
    engines = _pair(tiny_models, 64)
    yield engines
    for e in engines:
        e.shutdown()


@pytest.fixture(scope="module")
def kv_bound(tiny_models):
    engines = _pair(tiny_models, KV_TOKENS // 4)
    yield engines
    for e in engines:
        e.shutdown()


async def _complete(pool: WorkerPool, **extra) -> tuple[str, str | None, dict]:
    """One streamed completion through the gateway: (text, finish_reason, usage)."""
    app = create_app(pool, "tiny")
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=120)
    client = AsyncOpenAI(base_url="http://gw/v1", api_key="none", http_client=http, max_retries=0)
    stream = await client.completions.create(
        model="tiny", prompt=PROMPT, stream=True, temperature=0.8, seed=5, frequency_penalty=0.4,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, **extra)
    text, finish, usage = "", None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump(exclude={"prompt_tokens_details"})
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
    await http.aclose()
    return text, finish, usage


def _with_and_without_a_kill(engines, **extra):
    healthy = WorkerPool(lambda a: LocalWorkerClient(engines[int(a)]), ["1"])
    failing = WorkerPool(lambda a: DiesAfter(LocalWorkerClient(engines[0]), 5) if a == "0"
                         else LocalWorkerClient(engines[1]), ["0", "1"])
    failing.outstanding["1"] = 1       # the first attempt goes to the worker that dies
    expected = asyncio.run(_complete(healthy, **extra))
    got = asyncio.run(_complete(failing, **extra))
    assert failing.failovers == 1
    return expected, got


def _prompt_tokens(engines) -> int:
    return len(engines[0].engine.tokenizer(PROMPT)["input_ids"])


@pytest.mark.parametrize("limit", ["context", "kv_cache"])
def test_max_tokens_up_to_the_limit_survives_a_kill(context_bound, kv_bound, limit):
    engines = context_bound if limit == "context" else kv_bound
    room = (CONTEXT if limit == "context" else KV_TOKENS) - _prompt_tokens(engines)
    expected, got = _with_and_without_a_kill(engines, max_tokens=room)
    assert expected[1] == "length" and expected[2]["completion_tokens"] == room
    assert got == expected


@pytest.mark.parametrize("limit", ["context", "kv_cache"])
def test_unset_max_tokens_ends_at_the_same_place_after_a_kill(context_bound, kv_bound, limit):
    engines = context_bound if limit == "context" else kv_bound
    room = (CONTEXT if limit == "context" else KV_TOKENS) - _prompt_tokens(engines)
    expected, got = _with_and_without_a_kill(engines, max_tokens=None)
    assert expected[1] == "length" and expected[2]["completion_tokens"] == room
    assert got == expected


@pytest.fixture(scope="module")
def full(tiny_models):
    """A replica whose queue is always full: every request it gets is Saturated (a 503)."""
    cfg = EngineConfig(model=tiny_models["llama"], dtype="float32", max_model_len=CONTEXT,
                       cache=CacheConfig(block_size=4, num_blocks=64), scheduler=SchedulerConfig(max_waiting=0))
    engine = AsyncEngine(Engine(cfg))
    yield engine
    engine.shutdown()


def test_a_full_replica_after_the_first_token_is_skipped(context_bound, full):
    """The worker dies after 5 chunks; the stream moves to a full replica (Saturated), then
    to a free one, and ends as the same request never interrupted."""
    clients = {"0": DiesAfter(LocalWorkerClient(context_bound[0]), 5), "1": LocalWorkerClient(full),
               "2": LocalWorkerClient(context_bound[1])}
    pool = WorkerPool(clients.__getitem__, list(clients))
    pool.outstanding.update({"1": 1, "2": 2})      # tried in order: dying, full, free
    healthy = WorkerPool(lambda a: LocalWorkerClient(context_bound[1]), ["2"])
    expected = asyncio.run(_complete(healthy, max_tokens=30))
    assert asyncio.run(_complete(pool, max_tokens=30)) == expected
    assert pool.routed == {"0": 1, "1": 1, "2": 1}
    assert expected[1] == "length" and expected[2]["completion_tokens"] == 30
