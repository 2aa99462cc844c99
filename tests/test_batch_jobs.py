"""OpenAI's Batch API on the gateway, through the official openai client against real
`tessera serve` / `tessera gateway` processes and a real Redis: files and batches end to end
(outputs equal the chat API's greedy answers), API keys and per-key isolation, oversize
uploads (413), cancel, a job that survives its gateway being SIGKILLed, and two gateways on
one Redis running each line once. The job store's Redis and in-process twin are checked for
the same lease / write-once / compare-and-set semantics."""
from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import time
import uuid

import httpx
import openai
import pytest

from tessera.batch_jobs.jobs import LeaseLost, MemoryJobStore, new_batch
from tessera.batch_jobs.redis_jobs import RedisJobStore
from servers import redis_url, tessera_gateway, tessera_serve, tessera_worker, wait_until

pytestmark = pytest.mark.e2e
MODEL = "llama"          # the tiny random checkpoint's directory name
KEY, OTHER_KEY = "sk-batch-a", "sk-batch-b"
FINAL = ("completed", "failed", "cancelled", "expired")


def chat_line(custom_id: str, content: str, max_tokens: int = 8, **extra) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                     "temperature": 0, **extra}}


def jsonl(lines: list) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def client(url: str, key: str | None = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key or "none", max_retries=0, timeout=60)


def wait_batch(c: openai.OpenAI, batch_id: str, until=lambda b: b.status in FINAL, timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    while True:
        b = c.batches.retrieve(batch_id)
        if until(b):
            return b
        assert time.monotonic() < deadline, f"batch stuck: {b}"
        time.sleep(0.1)


def records(c: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [json.loads(x) for x in c.files.content(file_id).text.splitlines()] if file_id else []


def chat_text(url: str, body: dict) -> str:
    """What the chat API answers for `body` (sent as it is: vLLM's extensions included)."""
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def generations(url: str) -> float:
    """Generations this gateway has run (its e2e latency histogram's count)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(re.search(r"^tessera_e2e_request_latency_seconds_count\{[^}]*\} (\S+)$", text, re.M)[1])


@pytest.fixture(scope="module")
def redis():
    with redis_url() as url:
        yield url


@pytest.fixture(scope="module")
def served(tiny_models, redis, tmp_path_factory):
    files = tmp_path_factory.mktemp("files")
    with tessera_serve("--model", tiny_models["llama"], "--dtype", "float32", "--threads", "1",
                       "--jobs-redis", redis, "--files-dir", str(files), "--max-file-bytes", "32768") as url:
        yield url


@pytest.fixture(scope="module")
def worker(tiny_models):
    with tessera_worker("--model", tiny_models["llama"], "--dtype", "float32", "--threads", "1") as (address, _):
        yield address


def test_batch_api_through_the_openai_client(served):
    c = client(served)
    lines = [chat_line(f"req-{i}", f"Say something about {i}") for i in range(5)]
    lines += ["{not json", chat_line("too-long", "x", max_tokens=10**6)]
    up = c.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")
    assert (up.object, up.purpose, up.bytes, up.filename) == ("file", "batch", len(jsonl(lines)), "requests.jsonl")
    assert c.files.retrieve(up.id).id == up.id and up.id in [f.id for f in c.files.list()]
    assert c.files.content(up.id).content == jsonl(lines)

    batch = c.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h",
                             metadata={"run": "e2e"})
    assert batch.status == "validating" and batch.metadata == {"run": "e2e"}
    done = wait_batch(c, batch.id)
    assert done.status == "completed" and done.in_progress_at and done.finalizing_at and done.completed_at
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (7, 5, 2)
    assert batch.id in [b.id for b in c.batches.list()]

    out = {r["custom_id"]: r for r in records(c, done.output_file_id)}
    assert sorted(out) == [f"req-{i}" for i in range(5)]
    for line in lines[:5]:
        direct = c.chat.completions.create(**line["body"])
        body = out[line["custom_id"]]["response"]["body"]
        assert out[line["custom_id"]]["response"]["status_code"] == 200 and out[line["custom_id"]]["error"] is None
        assert body["choices"][0]["message"]["content"] == direct.choices[0].message.content
    errors = records(c, done.error_file_id)
    assert errors[0]["custom_id"] is None and errors[0]["error"]["line"] == 6 and errors[0]["response"] is None
    assert errors[1]["custom_id"] == "too-long" and errors[1]["response"]["status_code"] == 400
    assert errors[1]["response"]["body"]["error"]["code"] == "context_length_exceeded"
    assert c.files.retrieve(done.output_file_id).purpose == "batch_output"

    assert c.files.delete(up.id).deleted
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(up.id)
    with pytest.raises(openai.ConflictError):
        c.batches.cancel(batch.id)


def test_keys_guard_files_and_batches(worker, redis, tmp_path):
    with tessera_gateway("--worker", worker, "--jobs-redis", redis, "--registry-prefix", f"t-{uuid.uuid4().hex[:8]}",
                         "--files-dir", str(tmp_path), "--api-key", KEY, "--api-key", OTHER_KEY) as (url, _):
        check_keys(url)


def check_keys(served: str) -> None:
    c = client(served)
    up = c.files.create(file=("a.jsonl", jsonl([chat_line("a", "hi")])), purpose="batch")
    batch = c.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h")
    for path in ("/v1/files", f"/v1/files/{up.id}/content", "/v1/batches", f"/v1/batches/{batch.id}"):
        r = httpx.get(served + path, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    other = client(served, OTHER_KEY)      # another key sees none of it
    assert up.id not in [f.id for f in other.files.list()] and batch.id not in [b.id for b in other.batches.list()]
    with pytest.raises(openai.NotFoundError):
        other.files.content(up.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.BadRequestError):
        other.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h")
    for bad, param in (({"endpoint": "/v1/embeddings"}, "endpoint"), ({"completion_window": "1h"}, "completion_window")):
        args = {"input_file_id": up.id, "endpoint": "/v1/chat/completions", "completion_window": "24h"} | bad
        r = httpx.post(served + "/v1/batches", json=args, headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert wait_batch(c, batch.id).status == "completed"


def test_oversize_upload_is_413_and_a_bad_file_fails_the_batch(served):
    c = client(served)
    before = [f.id for f in c.files.list()]
    with pytest.raises(openai.APIStatusError) as e:
        c.files.create(file=("big.jsonl", b"x" * 40000), purpose="batch")
    assert e.value.status_code == 413 and e.value.body["code"] == "request_too_large"

    def chunked():      # no Content-Length: the route counts the bytes as they stream to disk
        head = b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--B\r\n' \
               b'Content-Disposition: form-data; name="file"; filename="c.jsonl"\r\n\r\n'
        yield head
        for _ in range(40):
            yield b"y" * 1000
        yield b"\r\n--B--\r\n"
    r = httpx.post(served + "/v1/files", content=chunked(), timeout=10,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "multipart/form-data; boundary=B"})
    assert r.status_code == 413 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert [f.id for f in c.files.list()] == before       # neither refused upload left a file

    dup = c.files.create(file=("dup.jsonl", jsonl([chat_line("x", "a"), chat_line("x", "b")])), purpose="batch")
    failed = wait_batch(c, c.batches.create(input_file_id=dup.id, endpoint="/v1/chat/completions",
                                            completion_window="24h").id)
    assert failed.status == "failed" and failed.errors.data[0].line == 2 and failed.failed_at
    assert "repeats line 1" in failed.errors.data[0].message


def test_cancel(served):
    c = client(served)
    lines = [chat_line(f"long-{i}", f"count {i}", max_tokens=200, ignore_eos=True) for i in range(40)]
    up = c.files.create(file=("long.jsonl", jsonl(lines)), purpose="batch")
    batch = c.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_batch(c, batch.id, lambda b: b.request_counts.completed >= 1)
    assert c.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = wait_batch(c, batch.id)
    assert done.status == "cancelled" and done.cancelling_at and done.cancelled_at
    assert 1 <= done.request_counts.completed < 40
    assert len(records(c, done.output_file_id)) == done.request_counts.completed
    assert c.batches.cancel(batch.id).status == "cancelled"


@contextlib.contextmanager
def gateway(worker: str, redis: str, prefix: str, files: str):
    with tessera_gateway("--worker", worker, "--jobs-redis", redis, "--registry-prefix", prefix, "--files-dir", files,
                         "--batch-lease-s", "6", "--batch-concurrency", "1") as (url, proc):
        yield url, proc


def check_once(c: openai.OpenAI, done, lines: list[dict], url: str) -> None:
    """Each line exactly once in the output, with the chat API's greedy answer."""
    assert done.status == "completed" and done.request_counts.completed == len(lines)
    out = records(c, done.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(line["custom_id"] for line in lines)
    texts = {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"] for r in out}
    assert texts[lines[0]["custom_id"]] == chat_text(url, lines[0]["body"])


async def recorded(redis: str, prefix: str, batch_id: str) -> int:
    store = RedisJobStore(redis, prefix)
    try:
        return (await store.get(batch_id))["completed"]
    finally:
        await store.close()


def test_job_survives_its_gateway_being_killed(worker, redis, tmp_path):
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    lines = [chat_line(f"r-{i}", f"story {i}", max_tokens=48, ignore_eos=True) for i in range(24)]
    with gateway(worker, redis, prefix, str(tmp_path)) as (url, proc):
        c = client(url)
        up = c.files.create(file=("r.jsonl", jsonl(lines)), purpose="batch")
        batch = c.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h")
        before = wait_batch(c, batch.id, lambda b: b.request_counts.completed >= 3).request_counts.completed
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    # What the killed gateway recorded, read before the next one starts: once it is up its
    # runner may finish a line before any request of ours could ask.
    at_kill = asyncio.run(recorded(redis, prefix, batch.id))
    assert at_kill < len(lines), "the job ended before the kill: make it longer"
    with gateway(worker, redis, prefix, str(tmp_path)) as (url, _):
        c = client(url)
        done = wait_batch(c, batch.id)
        ran = generations(url)
        assert before <= at_kill and ran == len(lines) - at_kill     # what was done before the kill is skipped
        check_once(c, done, lines, url)


def test_two_gateways_on_one_redis_run_each_line_once(worker, redis, tmp_path):
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    with gateway(worker, redis, prefix, str(tmp_path)) as (a, _), gateway(worker, redis, prefix, str(tmp_path)) as (b, _):
        jobs = []
        for j in range(4):
            url = (a, b)[j % 2]
            lines = [chat_line(f"j{j}-{i}", f"job {j} line {i}", max_tokens=16) for i in range(6)]
            c = client(url)
            up = c.files.create(file=(f"{j}.jsonl", jsonl(lines)), purpose="batch")
            jobs.append((c.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions",
                                          completion_window="24h").id, lines))
        for batch_id, lines in jobs:
            check_once(client(a), wait_batch(client(a), batch_id), lines, b)
        # no failure here, so each line ran exactly once (+ one direct chat per job in check_once)
        assert generations(a) + generations(b) == 4 * 6 + 4


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_job_store_and_its_twin_agree(kind, redis):
    async def main():
        store = MemoryJobStore() if kind == "memory" else RedisJobStore(redis, f"t-{uuid.uuid4().hex[:8]}")
        try:
            first, second = (new_batch("file-x", "/v1/completions", "24h", None, "me", None) for _ in range(2))
            await store.create(first)
            await store.create(second)
            assert [r["id"] for r in (await store.list("me", None, 1))[0]] == [second["id"]]
            assert (await store.list("me", second["id"], 5)) == ([await store.get(first["id"])], False)
            assert (await store.list("you", None, 5)) == ([], False)
            assert await store.acquire(first["id"], "t1", 5) and not await store.acquire(first["id"], "t2", 5)
            assert await store.record(first["id"], "t1", 0, {"n": 1}, "completed")
            assert not await store.record(first["id"], "t1", 0, {"n": 2}, "completed")      # written once
            with pytest.raises(LeaseLost):
                await store.record(first["id"], "t2", 1, {}, "failed")
            assert await store.update(first["id"], ("validating",), {"status": "cancelling"})
            assert not await store.update(first["id"], ("validating",), {"status": "in_progress"})
            with pytest.raises(LeaseLost):
                await store.update(first["id"], ("cancelling",), {"status": "cancelled"}, "t2")
            assert await store.update(first["id"], ("cancelling",), {"status": "cancelled"}, "t1")
            got = await store.get(first["id"])
            assert (got["status"], got["completed"], got["failed"]) == ("cancelled", 1, 0)
            assert await store.finished(first["id"]) == {0: {"n": 1}}
            assert await store.active() == [second["id"]]
            await store.release(first["id"], "t1")
            assert await store.acquire(first["id"], "t2", 0.2)
            await asyncio.sleep(0.3)
            assert await store.acquire(first["id"], "t3", 5) and not await store.renew(first["id"], "t2", 5)
        finally:
            await store.close()
    asyncio.run(main())


def test_runner_waits_out_429_and_expires_what_it_cannot_finish(tmp_path):
    """The runner on the in-process job store (what `tessera serve` uses without Redis) and a
    stand-in server: a 429 is retried after its Retry-After, not recorded; lines still unsent
    when the completion window ends fail with batch_expired, and the batch is `expired`."""
    from tessera.batch_jobs.config import BatchConfig
    from tessera.batch_jobs.files import FileStore
    from tessera.batch_jobs.runner import BatchRunner

    tried: set[str] = set()

    async def server(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        first = body["messages"][0]["content"] not in tried
        tried.add(body["messages"][0]["content"])
        if first:
            return httpx.Response(429, headers={"Retry-After": "0.1"}, json={"error": {"message": "slow down"}})
        await asyncio.sleep(0.3)
        return httpx.Response(200, json={"choices": [{"message": {"content": "ok"}}]})

    async def main():
        store, files = MemoryJobStore(), FileStore(str(tmp_path), 1 << 20)
        lines = [chat_line(f"x-{i}", f"line {i}") for i in range(10)]
        files.create("file-in", jsonl(lines), "in.jsonl", "batch", "")
        job = new_batch("file-in", "/v1/chat/completions", "24h", None, "", None)
        job["expires_at"] = time.time() + 1.5
        await store.create(job)
        runner = BatchRunner(store, files, lambda key: httpx.AsyncClient(
            transport=httpx.MockTransport(server), base_url="http://test/v1"),
            BatchConfig(batch_concurrency=1, batch_lease_s=1), poll_s=0.05)
        serving = asyncio.create_task(runner.serve())
        while (await store.get(job["id"]))["status"] not in FINAL:
            await asyncio.sleep(0.05)
        serving.cancel()
        return await store.get(job["id"]), store.leases

    done, leases = asyncio.run(main())
    assert done["status"] == "expired" and done["expired_at"] and not leases
    assert 1 <= done["completed"] < 10 and done["completed"] + done["failed"] == done["total"] == 10
    ok = [json.loads(x) for x in (tmp_path / f"{done['output_file_id']}.data").read_text().splitlines()]
    expired = [json.loads(x) for x in (tmp_path / f"{done['error_file_id']}.data").read_text().splitlines()]
    assert all(r["response"]["status_code"] == 200 for r in ok)     # no 429 was kept
    assert {r["error"]["code"] for r in expired} == {"batch_expired"}
    assert sorted(r["custom_id"] for r in ok + expired) == sorted(f"x-{i}" for i in range(10))


def test_two_keys_of_one_name_see_only_their_own_files(redis, tmp_path):
    """Key names are labels (`tessera keys add NAME` twice makes two keys): files belong to the
    key, so one never lists or reads the other's upload."""
    import asyncio

    from tessera.batch_jobs.config import BatchConfig
    from tessera.entrypoints.gateway.admission import Admission, AdmissionConfig
    from tessera.entrypoints.gateway.app import create_app
    from tessera.entrypoints.gateway.batch_api import BatchAPI
    from tessera.local_client import LocalWorkerClient
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    admission = Admission(AdmissionConfig(keys_from_redis=True, require_key=True), redis, prefix)
    a, b = (asyncio.run(Admission(AdmissionConfig(), redis, prefix).add_key("team")) for _ in range(2))
    batch = BatchAPI(BatchConfig(files_dir=str(tmp_path)), MemoryJobStore())
    app = create_app(LocalWorkerClient(None), MODEL, admission=admission, batch=batch)

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            up = await http.post("/v1/files", headers={"Authorization": f"Bearer {a}"}, data={"purpose": "batch"},
                                 files={"file": ("a.jsonl", jsonl([chat_line("a", "hi")]))})
            assert up.status_code == 200, up.text
            file_id = up.json()["id"]
            mine = await http.get("/v1/files", headers={"Authorization": f"Bearer {a}"})
            theirs = await http.get("/v1/files", headers={"Authorization": f"Bearer {b}"})
            assert file_id in [f["id"] for f in mine.json()["data"]]
            assert file_id not in [f["id"] for f in theirs.json()["data"]]
            r = await http.get(f"/v1/files/{file_id}/content", headers={"Authorization": f"Bearer {b}"})
            assert r.status_code == 404
    asyncio.run(run())
