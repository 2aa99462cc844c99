"""`tessera run-batch`: OpenAI batch files offline, as a user runs it (a subprocess) on a tiny
random model, in process and against a running `tessera serve` (--url). Greedy outputs equal
what the chat and completions APIs answer for the same bodies; malformed lines get error
records with their line numbers and never stop the file; malformed files are refused whole."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import pytest

from tessera.batch_jobs.format import FileError, parse
from servers import tessera_serve

MODEL = "llama"        # the tiny random checkpoint's directory name


def chat(custom_id: str, content: str, **extra) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 12,
                     "temperature": 0, **extra}}


def completion(custom_id: str, prompt: str) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}}


REQUESTS = [chat(f"chat-{i}", f"Tell me about {topic}") for i, topic in enumerate(["cats", "rivers", "the moon"])]
REQUESTS += [completion("comp-0", "Once upon a time"), chat("penalties", "Count", frequency_penalty=1.5, stop=["."])]
MALFORMED = [
    ("{not json", None, "not valid JSON"),
    ({"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {}}, "get", "method must be POST"),
    ({"custom_id": "list-body", "method": "POST", "url": "/v1/completions", "body": [1]}, "list-body", "body must"),
    ({**chat("streamed", "hi"), "body": {**chat("s", "hi")["body"], "stream": True}}, "streamed", "stream"),
]


def run_batch(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tessera.cli", "run-batch", *args], capture_output=True, text=True,
                          timeout=timeout)


def write(path, lines: list) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


@pytest.fixture(scope="module")
def served(tiny_models):
    with tessera_serve("--model", tiny_models["llama"], "--dtype", "float32", "--threads", "1") as url:
        yield url


def answer(url: str, request: dict) -> str:
    """The API's own answer for a batch request's body."""
    r = httpx.post(url + request["url"], json=request["body"], timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def text_of(record: dict) -> str:
    choice = record["response"]["body"]["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


@pytest.mark.e2e
def test_run_batch_in_process_and_against_a_deployment(tiny_models, served, tmp_path):
    bad_param = chat("bad-param", "hi", max_tokens=-1)
    lines = [REQUESTS[0], MALFORMED[0][0], *REQUESTS[1:], *(m[0] for m in MALFORMED[1:]), bad_param]
    source = write(tmp_path / "requests.jsonl", lines)
    expected = {r["custom_id"]: answer(served, r) for r in REQUESTS}
    runs = {"in-process": ["--model", tiny_models["llama"], "--dtype", "float32", "--threads", "1"],
            "url": ["--url", served + "/v1", "--concurrency", "3"]}
    for name, args in runs.items():
        out = tmp_path / f"{name}.jsonl"
        done = run_batch("-i", source, "-o", str(out), *args)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"{len(lines)} requests: {len(REQUESTS)} succeeded" in done.stderr
        assert float(re.search(r"failed in ([0-9.]+) s", done.stderr).group(1)) > 0     # bench pq reads this
        records = [json.loads(x) for x in out.read_text().splitlines()]
        assert len(records) == len(lines) and len({r["id"] for r in records}) == len(lines)
        by_id = {r["custom_id"]: r for r in records if r["custom_id"]}
        for custom_id, text in expected.items():
            record = by_id[custom_id]
            assert record["error"] is None and record["response"]["status_code"] == 200
            assert record["response"]["request_id"] and text_of(record) == text, (name, custom_id)
        assert records[1]["custom_id"] is None and records[1]["error"]["line"] == 2
        assert "not valid JSON" in records[1]["error"]["message"]
        for (_, custom_id, why), number in zip(MALFORMED[1:], range(len(REQUESTS) + 2, len(lines))):
            assert by_id[custom_id]["response"] is None and why in by_id[custom_id]["error"]["message"]
            assert by_id[custom_id]["error"]["line"] == number
        refused = by_id["bad-param"]["response"]
        assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "max_tokens"


BAD_FILES = [
    ("not-jsonl", ['[{"custom_id": "a",', '  "url": "/v1/completions"}]'], "not a JSONL file"),
    ("unknown-url", [REQUESTS[0], {**REQUESTS[1], "url": "/v1/embeddings"}], "line 2: unknown url"),
    ("missing-custom-id", [REQUESTS[0], {k: v for k, v in REQUESTS[1].items() if k != "custom_id"}],
     "line 2: custom_id is missing"),
    ("duplicate-custom-id", [REQUESTS[0], REQUESTS[1], {**REQUESTS[2], "custom_id": "chat-0"}],
     "line 3: custom_id 'chat-0' repeats line 1"),
]


@pytest.mark.parametrize("name,lines,message", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_malformed_files_are_refused_before_any_engine_loads(name, lines, message, tmp_path):
    out = tmp_path / "out.jsonl"
    done = run_batch("-i", write(tmp_path / "in.jsonl", lines), "-o", str(out), "--model", "no-such-model",
                     timeout=60)
    assert done.returncode == 1 and message in done.stderr and not out.exists(), done.stderr[-2000:]


def test_file_rules():
    ok = json.dumps(REQUESTS[0]).encode()
    with pytest.raises(FileError, match="not UTF-8"):
        parse(b"\xff\xfe" + ok)
    with pytest.raises(FileError, match="holds no requests"):
        parse(b"\n  \n")
    with pytest.raises(FileError, match="differs from the batch's endpoint"):
        parse(ok, endpoint="/v1/completions")
    lines = parse(b"\n" + ok + b"\n\n" + b'"just a string"\n')
    assert [(x.index, x.line, x.custom_id) for x in lines] == [(0, 2, "chat-0"), (1, 4, None)]
    assert lines[1].problem == "not a JSON object"
