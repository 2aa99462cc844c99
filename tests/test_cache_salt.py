"""cache_salt (vLLM's request field) and per-key salting, through a real `tessera serve` with
API keys and the official openai client: the prefix cache is shared by every caller, so
usage.prompt_tokens_details.cached_tokens would tell one caller what another sent. Requests
with different salts, or from different keys, never share cached blocks; the same salt from
the same key does."""
from __future__ import annotations

import asyncio
import random

import httpx
import openai
import pytest

from servers import _process, free_port
from tessera.async_engine import AsyncEngine
from tessera.config import CacheConfig, EngineConfig
from tessera.engine import Engine
from tessera.entrypoints.gateway.admission import Admission, AdmissionConfig, digest
from tessera.entrypoints.gateway.app import create_app
from tessera.local_client import LocalWorkerClient

pytestmark = pytest.mark.e2e
KEY_A, KEY_B = "sk-salt-a", "sk-salt-b"


@pytest.fixture(scope="module")
def url(tiny_models):
    """`tessera serve --api-key A --api-key B`, ready once /health (which needs a key) passes."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(base + "/health", headers={"Authorization": f"Bearer {KEY_A}"}, timeout=30).is_success
        except httpx.HTTPError:
            return False
    with _process(["serve", "--port", str(port), "--worker-port", str(free_port()), "--model", tiny_models["llama"],
                   "--dtype", "float32", "--max-model-len", "512", "--served-model-name", "tiny",
                   "--api-key", KEY_A, "--api-key", KEY_B], ready, 180):
        yield base


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def prompt(seed: int) -> list[int]:
    """48 token ids no other test sends: three full 16-token blocks."""
    return random.Random(seed).choices(range(100, 40000), k=48)


def cached(c: openai.OpenAI, tokens: list[int], salt: str | None = None, chat: bool = False) -> int:
    extra = {"cache_salt": salt} if salt else {}
    if chat:
        text = " ".join(str(t) for t in tokens[:16])     # as the system message: the first block holds it
        r = c.chat.completions.create(model="tiny", messages=[{"role": "system", "content": text}], max_tokens=1,
                                      extra_body=extra)
    else:
        r = c.completions.create(model="tiny", prompt=tokens, max_tokens=1, extra_body=extra)
    return r.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("chat", [False, True])
def test_requests_with_different_cache_salts_share_no_prefix(url, chat):
    c = client(url, KEY_A)
    p = prompt(1 + chat)
    assert cached(c, p, "tenant-1", chat) == 0
    assert cached(c, p, "tenant-2", chat) == 0
    assert cached(c, p, None, chat) == 0
    assert cached(c, p, "tenant-1", chat) > 0 and cached(c, p, None, chat) > 0


@pytest.mark.parametrize("chat", [False, True])
def test_each_api_key_has_its_own_prefix_cache(url, chat):
    a, b = client(url, KEY_A), client(url, KEY_B)
    p = prompt(3 + chat)
    assert cached(a, p, chat=chat) == 0
    assert cached(b, p, chat=chat) == 0                     # the same prompt, another key
    assert cached(b, p, "same-salt", chat) == 0 and cached(a, p, "same-salt", chat) == 0
    assert cached(a, p, chat=chat) > 0 and cached(b, p, chat=chat) > 0


def test_a_bad_cache_salt_is_400(url):
    for salt in ("", 5, ["x"]):
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [5, 6], "cache_salt": salt},
                       headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def test_keys_share_the_cache_when_salting_by_key_is_off(tiny_models):
    """--no-cache-salt-by-key: one tenant behind several keys keeps one prefix cache."""
    engine = AsyncEngine(Engine(EngineConfig(model=tiny_models["llama"], dtype="float32", max_model_len=128,
                                             cache=CacheConfig(block_size=16, num_blocks=64))))
    config = AdmissionConfig(require_key=True, key_digests=(digest(KEY_A), digest(KEY_B)), cache_salt_by_key=False)
    app = create_app(LocalWorkerClient(engine), "tiny", admission=Admission(config))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=60) as c:
            answers = []
            for key in (KEY_A, KEY_B):
                r = await c.post("/v1/completions", json={"model": "tiny", "prompt": prompt(5), "max_tokens": 1},
                                 headers={"Authorization": f"Bearer {key}"})
                answers.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            return answers
    try:
        assert asyncio.run(main()) == [0, 32]
    finally:
        engine.shutdown()
