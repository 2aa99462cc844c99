"""Hostile values sent to a real `tessera serve` (gateway -> gRPC -> worker) on both endpoints
and through the Batch API, none of which may reach the engine as it is: non-finite numbers,
integers too large for a float, logit_bias keys that are digits only to str.isdigit(), lone UTF-16
surrogates, and lists as long as the body limit allows. Each is a 400 in OpenAI's error JSON naming
the field; a temperature too small to divide by samples greedily, as in vLLM."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from servers import tessera_serve
from tessera.async_engine import AsyncEngine
from tessera.config import CacheConfig, EngineConfig, SchedulerConfig
from tessera.engine import Engine
from tessera.entrypoints.gateway.app import create_app
from tessera.local_client import LocalWorkerClient

pytestmark = pytest.mark.e2e
CAP = 8       # the served gateway's --max-logit-bias, --max-stop-token-ids and --max-messages
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def url(tiny_models, tmp_path_factory):
    files = tmp_path_factory.mktemp("files")
    with tessera_serve("--model", tiny_models["llama"], "--dtype", "float32", "--max-model-len", "256",
                       "--served-model-name", "tiny", "--files-dir", str(files), "--max-logit-bias", str(CAP),
                       "--max-stop-token-ids", str(CAP), "--max-messages", str(CAP)) as u:
        yield u


def body(path: str, **fields) -> dict:
    if path == "/v1/chat/completions":
        return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, **fields}


def post(url: str, path: str, raw: str) -> httpx.Response:
    """POST a body written by hand: JSON's NaN, Infinity and "\\ud800" escapes stay as sent."""
    return httpx.post(url + path, content=raw.encode(), headers={"content-type": "application/json"}, timeout=60)


def with_field(path: str, name: str, literal: str) -> str:
    """The body for `path` with field `name` set to the JSON text `literal`."""
    return json.dumps(body(path))[:-1] + f', "{name}": {literal}}}'


def assert_400(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, (param, r.status_code, r.text[:300])
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"], error


PATHS = ["/v1/chat/completions", "/v1/completions"]
FLOATS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]
NOT_FINITE = ["NaN", "Infinity", "-Infinity", "1" + "0" * 400, "1e39"]   # the last two: past float, float32


@pytest.mark.parametrize("path", PATHS)
def test_non_finite_numbers_are_400_naming_the_field(url, path):
    for name in FLOATS:
        for literal in NOT_FINITE:
            assert_400(post(url, path, with_field(path, name, literal)), name)
    for literal in NOT_FINITE:
        assert_400(post(url, path, with_field(path, "logit_bias", f'{{"5": {literal}}}')), "logit_bias")
    assert post(url, path, with_field(path, "temperature", "5")).status_code == 200   # vLLM's range: > 2 is fine


@pytest.mark.parametrize("path", PATHS)
def test_a_temperature_too_small_to_divide_by_is_greedy(url, path):
    """Logits divided by 1e-39 overflow to inf (NaN probabilities); below vLLM's 1e-5 it is greedy."""
    def text(temperature: float) -> str:
        r = post(url, path, json.dumps(body(path, temperature=temperature, max_tokens=12, ignore_eos=True)))
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if path == PATHS[0] else choice["text"]
    greedy = text(0)
    assert [text(t) for t in (1e-39, 1e-30, 1e-6)] == [greedy] * 3


@pytest.mark.parametrize("path", PATHS)
def test_logit_bias_keys_must_be_ascii_token_ids(url, path):
    for key in ["\u00b2", "\u0661\u0662", "1_0", "-1", "", "x", "9" * 5000]:
        assert_400(post(url, path, json.dumps(body(path, logit_bias={key: 1}))), "logit_bias")
    assert post(url, path, json.dumps(body(path, logit_bias={" 5": -100}))).status_code == 200


@pytest.mark.parametrize("path", PATHS)
def test_lone_surrogates_are_400(url, path):
    surrogate = '"a\\ud800b"'
    fields = {"stop": f"[{surrogate}]", "user": surrogate, "cache_salt": surrogate,
              "logit_bias": f'{{{surrogate}: 1}}'}
    if path == "/v1/chat/completions":
        chat = json.dumps(body(path))
        assert_400(post(url, path, chat.replace('"hi"', surrogate)), "messages")
        assert_400(post(url, path, chat.replace('"hi"', f'[{{"type": "text", "text": {surrogate}}}]')), "messages")
    else:
        fields["prompt"] = surrogate
        assert_400(post(url, path, with_field(path, "prompt", f"[{surrogate}, \"ok\"]")), "prompt")
    for name, literal in fields.items():
        assert_400(post(url, path, with_field(path, name, literal)), name)


def entries(name: str, n: int):
    """n entries of the capped list `name`."""
    if name == "logit_bias":
        return {str(i): 1 for i in range(n)}
    if name == "stop_token_ids":
        return list(range(100, 100 + n))
    return [{"role": "user", "content": f"turn {i}"} for i in range(n)]


def capped(path: str) -> list[str]:
    return ["logit_bias", "stop_token_ids"] + (["messages"] if path == PATHS[0] else [])


@pytest.mark.parametrize("path", PATHS)
def test_lists_are_capped_by_the_gateways_flags(url, path):
    """--max-logit-bias, --max-stop-token-ids, --max-messages: at the cap 200, past it 400."""
    for name in capped(path):
        assert post(url, path, json.dumps(body(path, **{name: entries(name, CAP)}))).status_code == 200
        assert_400(post(url, path, json.dumps(body(path, **{name: entries(name, CAP + 1)}))), name)


@pytest.fixture(scope="module")
def default_app(tiny_models):
    """The gateway with its default caps, in process."""
    cfg = EngineConfig(model=tiny_models["llama"], dtype="float32", max_model_len=96,
                       cache=CacheConfig(block_size=4, num_blocks=128), scheduler=SchedulerConfig(max_num_seqs=4))
    engine = AsyncEngine(Engine(cfg))
    yield create_app(LocalWorkerClient(engine), "tiny")
    engine.shutdown()


@pytest.mark.parametrize("path", PATHS)
def test_default_caps_refuse_a_body_full_of_entries(default_app, path):
    """300 logit_bias entries (OpenAI's cap), 1024 stop_token_ids and 2048 messages by default.
    A body under the 1 MiB limit holds 100,000 logit_bias entries, each applied on every step."""
    async def send(payload: dict) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=default_app), base_url="http://gw",
                                     timeout=60) as c:
            return await c.post(path, content=json.dumps(payload, separators=(",", ":")),
                                headers={"content-type": "application/json"})
    defaults = {"logit_bias": 300, "stop_token_ids": 1024, "messages": 2048}
    for name in capped(path):
        at_cap = asyncio.run(send(body(path, **{name: entries(name, defaults[name])})))
        # 2048 messages are longer than this model's context: refused for that, not their number
        assert at_cap.status_code == 200 or at_cap.json()["error"]["code"] == "context_length_exceeded", at_cap.text
        assert_400(asyncio.run(send(body(path, **{name: entries(name, defaults[name] + 1)}))), name)
    assert_400(asyncio.run(send(body(path, logit_bias=entries("logit_bias", 100_000)))), "logit_bias")


def test_batch_lines_meet_the_same_checks(url):
    """The Batch API sends each line through the same routes: a hostile line fails alone, as a
    400 in the error file, and the good line beside it completes."""
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    good = {"custom_id": "good", "method": "POST", "url": "/v1/chat/completions", "body": body(PATHS[0])}
    lines = [json.dumps(good),
             json.dumps(dict(good, custom_id="nan", body=body(PATHS[0], temperature=float("nan")))),
             json.dumps(dict(good, custom_id="surrogate", body=body(PATHS[0], user="a\ud800"))),
             json.dumps(dict(good, custom_id="superscript", body=body(PATHS[0], logit_bias={"\u00b2": 1})))]
    upload = c.files.create(file=("hostile.jsonl", "\n".join(lines).encode() + b"\n"), purpose="batch")
    batch = c.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
        batch = c.batches.retrieve(batch.id)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 3)
    errors = {r["custom_id"]: r["response"]
              for r in map(json.loads, c.files.content(batch.error_file_id).text.splitlines())}
    assert {k: (r["status_code"], r["body"]["error"]["param"]) for k, r in errors.items()} == {
        "nan": (400, "temperature"), "surrogate": (400, "user"), "superscript": (400, "logit_bias")}
