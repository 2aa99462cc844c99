"""The OpenAI API end to end: `tessera serve` (worker + gateway processes) on SmolLM2, driven
by the official openai client and raw HTTP."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from servers import tessera_serve

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def url():
    with tessera_serve("--max-model-len", "2048", "--max-num-seqs", "16") as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_and_chat_says_paris(client, url):
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    raw = httpx.post(url + "/v1/chat/completions", headers={"X-Request-Id": "abc-123"},
                     json={"model": MODEL, "messages": FRANCE, "max_tokens": 2}, timeout=60)
    assert raw.headers["x-request-id"] == "abc-123"


def test_completions_length_and_usage(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5


def test_streaming_chat_equals_non_streaming(client):
    full = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=30)
    chunks = list(client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=30,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_n_2_seeded_and_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, n=2, temperature=1.0, seed=3, max_tokens=8,
                                       logprobs=True, top_logprobs=3)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        content = c.logprobs.content
        assert 1 <= len(content) <= 8 and all(len(lp.top_logprobs) == 3 for lp in content)
        assert all(lp.logprob <= 0 for lp in content)
        assert bytes(sum((lp.bytes for lp in content), [])).decode("utf-8", "replace").startswith(
            c.message.content[:3])
    again = client.chat.completions.create(model=MODEL, messages=FRANCE, n=2, temperature=1.0, seed=3, max_tokens=8)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    comp = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=4, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == comp.choices[0].text


def test_stop_strings(client):
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, stop=["Paris"])
    assert "Paris" not in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    s = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, stop=["Paris"], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in s if c.choices) == r.choices[0].message.content


def test_streaming_multibyte_text_is_whole_utf8(client):
    prompt = "Chinese: 你好世界。Emoji: 😀🎉. Japanese: こんにちは。Chinese: 你好"
    full = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=24)
    pieces = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                                                   max_tokens=24, stream=True) if c.choices]
    assert any(ord(ch) > 127 for ch in full.choices[0].text)
    for p in pieces:
        p.encode("utf-8")
        assert "\ufffd" not in p
    assert "".join(pieces) == full.choices[0].text


BAD = [
    ("invalid json", b'{"model": ', 400, None),
    ("invalid utf-8", b'{"model": "\xff\xfe", "messages": []}', 400, None),
    ("wrong type", {"model": MODEL, "messages": FRANCE, "max_tokens": "ten"}, 400, None),
    ("negative max_tokens", {"model": MODEL, "messages": FRANCE, "max_tokens": -1}, 400, None),
    ("huge max_tokens", {"model": MODEL, "messages": FRANCE, "max_tokens": 10**9}, 400, "context_length_exceeded"),
    ("long prompt", {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 3000}]}, 400,
     "context_length_exceeded"),
    ("unknown model", {"model": "gpt-9", "messages": FRANCE}, 404, "model_not_found"),
    ("empty messages", {"model": MODEL, "messages": []}, 400, None),
    ("bad role", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("temperature", {"model": MODEL, "messages": FRANCE, "temperature": -1}, 400, None),
]


@pytest.mark.parametrize("name,body,status,code", BAD, ids=[b[0] for b in BAD])
def test_errors_have_openai_shape(url, name, body, status, code):
    kwargs = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    for stream in (False, True):
        if stream and isinstance(body, dict):
            kwargs = {"json": dict(body, stream=True)}
        r = httpx.post(url + "/v1/chat/completions", timeout=60, **kwargs)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert err["code"] == code


def test_prompt_too_long_for_completions(url):
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi " * 2100}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_disconnect_aborts_and_frees_blocks(url):
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 1000, "stream": True,
            "extra": 1, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data:")
            if got >= 3:
                break
    # 1000 tokens take over a minute here: the request can only be gone this soon by the abort
    wait_for(lambda: metric(url, "tessera_num_requests_running") == 0
             and metric(url, "tessera_kv_cache_usage_ratio") == 0, "request was not aborted after the client left")


def wait_for(condition, message: str, timeout_s: float = 15.0) -> None:
    """Poll: /metrics reads the worker's state through an RPC that a loaded machine may delay."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.2)


def test_health_and_metrics(url):
    h = httpx.get(url + "/health", timeout=30)
    assert h.status_code == 200 and h.json()["status"] == "ok"
    text = httpx.get(url + "/metrics", timeout=10).text
    for name in ("tessera_requests_total", "tessera_time_to_first_token_seconds_bucket",
                 "tessera_inter_token_latency_seconds_bucket", "tessera_e2e_request_latency_seconds_bucket",
                 "tessera_num_requests_running", "tessera_num_requests_waiting", "tessera_kv_cache_usage_ratio"):
        assert name in text
    assert 'model_name="SmolLM2-135M-Instruct"' in text
    assert json.loads(httpx.get(url + "/v1/models", timeout=10).text)["object"] == "list"


def test_bench_serve_against_the_live_server(url):
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "tessera.cli", "bench", "serve", "--base-url", url,
                          "--num-prompts", "3", "--concurrency", "2", "--input-len", "16", "--output-len", "4",
                          "--json"], capture_output=True, text=True, timeout=300, check=True).stdout
    result = json.loads(out)
    assert result["completed"] == 3 and result["failed"] == 0 and result["output_tok_s"] > 0
    assert result["ttft_ms"]["p50"] > 0 and result["tpot_ms"]["mean"] > 0
    # the worker's own timings, through gRPC and the gateway's /metrics: the three requests
    # finished between the bench's two scrapes; the worker's share of a TTFT lies inside it
    server = result["server_ms"]
    assert server["requests"] == 3 and server["prefill"] > 0 and server["decode"] > 0 and server["queue"] >= 0
    assert 0 < result["ttft_outside_engine_ms"] < result["ttft_ms"]["mean"]
    assert result["machine"]["busy_pct"] > 0    # this machine's CPU did the work


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_serve_counts_every_streamed_token(url, endpoint):
    """`tessera bench serve` reads the SSE streams with its own HTTP/1.1 client: every request
    completes with the usage's token count, and a request the server refuses is counted as
    failed with its status, not as a crash."""
    import subprocess
    import sys
    bench = [sys.executable, "-m", "tessera.cli", "bench", "serve", "--base-url", url, "--num-prompts", "3",
             "--input-len", "16", "--output-len", "6", "--endpoint", endpoint, "--json"]
    run = subprocess.run(bench, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout)
    assert (report["completed"], report["failed"], report["output_tokens"]) == (3, 0, 3 * 6), report
    assert report["tpot_ms"]["p50"] > 0
    run = subprocess.run(bench + ["--model", "no-such-model"], capture_output=True, text=True, timeout=300)
    report = json.loads(run.stdout)
    assert report["completed"] == 0 and report["failed"] == 3 and report["errors"][0].startswith("404"), report


def test_tokenize_and_detokenize_as_the_endpoints_count(client, url):
    """vLLM's /tokenize counts what the completion and chat endpoints count as the prompt (the
    chat template applied for messages); /detokenize gives the text back."""
    prompt = "The capital of France is"
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": prompt, "return_token_strs": True}).json()
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert r["count"] == len(r["tokens"]) == done.usage.prompt_tokens and r["max_model_len"] == 2048
    assert "".join(r["token_strs"]).replace("Ġ", " ") == prompt     # vocabulary pieces, as vLLM's
    assert httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json() == {"prompt": prompt}
    chat = httpx.post(url + "/tokenize", json={"messages": FRANCE}).json()
    answer = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=1, temperature=0)
    assert chat["count"] == answer.usage.prompt_tokens and chat["token_strs"] is None
    text = httpx.post(url + "/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert "What is the capital of France?" in text and text.rstrip().endswith("assistant")


@pytest.mark.parametrize("path, body, status, param", [
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [2**31]}, 400, None),          # past protobuf's int32: refused before
    ("/detokenize", {"tokens": ["a"]}, 400, None),
    ("/tokenize", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False}, 400,
     "add_generation_prompt"),
])
def test_tokenize_refusals(url, path, body, status, param):
    r = httpx.post(url + path, json=body)
    assert r.status_code == status, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param
