"""A pipeline as real processes, through what a user runs: `tessera up` of a three-stage
topology (tiny random llama, per-layer bits from a plan file, tcp) answers the official openai
client with the text a single `tessera serve` with the same bits gives; stage 0 registers as a
worker and the later stages as "pipeline_shard", and the gateway routes to stage 0 only; a
stage SIGKILLed mid-stream ends that stream with an error in bounded time (no hang), the
supervisor restarts it, and stage 0 relinks the ring for the next request; a stage whose
memory budget is too small refuses to start with a clear error."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
import yaml

from servers import Logged, tessera_serve, wait_until

pytestmark = pytest.mark.e2e
MODEL = "random:llama:num_hidden_layers=4"
BITS = [16, 8, 4, 16]
STAGES = ["0:1", "1:3", "3:4"]
PROMPTS = ["Count from one to ten.", "Name a colour."]


def low_ports(n: int) -> int:
    """p with p .. p + n - 1 free, below Linux's ephemeral range (32768-60999): a port that is
    polled before its process listens can otherwise be taken by a client's own connect()
    (a TCP self-connect) or by another process's bind(0), and the restarted stage never binds."""
    import random
    import socket
    while True:
        p = random.randrange(20000, 32000)
        try:
            for i in range(n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p + i))
            return p
        except OSError:
            continue


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def chat(url: str, prompt: str, max_tokens: int = 12) -> str:
    c = client(url)
    model = c.models.list().data[0].id
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], temperature=0,
                                  max_tokens=max_tokens, extra_body={"ignore_eos": True})
    return r.choices[0].message.content


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(json.dumps({"bits": BITS, "stages": [{"layers": s} for s in STAGES]}))
    return str(path)


@pytest.fixture(scope="module")
def expected(plan) -> list[str]:
    """What one `tessera serve` process with the same bits answers (one request at a time: a
    lone request is one micro-batch, the same GEMMs as in one process)."""
    with tessera_serve("--model", MODEL, "--dtype", "float32", "--quantization", plan, "--threads", "1") as url:
        return [chat(url, p) for p in PROMPTS]


@pytest.fixture(scope="module")
def pipeline(plan, tmp_path_factory):
    """`tessera up` of a pipeline topology: Redis, three stages (ranges from the plan), gateway."""
    port = low_ports(len(STAGES) + 1)
    stage_port = port + 1
    spec = {"name": "pipe", "model": MODEL, "dtype": "float32", "transport": "tcp", "roles": {
        "redis": {"port": 6379},   # tessera up starts its own Redis on a free port
        "pipeline_shard": {"port": stage_port, "plan": plan, "num_kv_blocks": 256, "stage_timeout_s": 3,
                           "stages": [{"threads": 1} for _ in STAGES]},
        "gateway": {"port": port}}}
    topology = tmp_path_factory.mktemp("up") / "pipe.yaml"
    topology.write_text(yaml.safe_dump(spec))
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    certs = topology.with_suffix(".certs")    # the deployment's certificates, so this test can call the stages too
    subprocess.run([sys.executable, "-m", "tessera.cli", "certs", str(topology), "--out", str(certs)], check=True)
    up = Logged("up", str(topology), "--certs", str(certs), "--restart-backoff-s", "0.2", "--shutdown-grace-s", "5",
                env=env)
    up.certs = certs
    url = f"http://127.0.0.1:{port}"
    try:
        up.wait_for(rf"tessera worker ready on 127.0.0.1:{stage_port}", 180)
        wait_until(lambda: _ok(url + "/health/ready"), 60, "the gateway never became ready")
        yield up, url
    finally:
        up.close()


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _registered(up: Logged) -> dict[str, str]:
    from tessera.registry import RedisRegistry
    redis_url = up.redis_url()

    async def roles():
        registry = RedisRegistry(redis_url, prefix="tessera:pipe")
        try:
            return {r.address: r.role for r in await registry.list()}
        finally:
            await registry.close()
    return asyncio.run(roles())


def test_up_pipeline_answers_like_one_serve_process(pipeline, expected):
    up, url = pipeline
    assert [chat(url, p) for p in PROMPTS] == expected
    wait_until(lambda: len(_registered(up)) == len(STAGES), 30, "the stages never registered")
    assert sorted(_registered(up).values()) == ["pipeline_shard", "pipeline_shard", "worker"]
    workers = [line for line in httpx.get(url + "/metrics").text.splitlines()
               if line.startswith("tessera_gateway_workers{")]
    assert workers and float(workers[0].split()[-1]) == 1, workers   # stage 0 only


def test_every_stage_counts_the_seconds_in_its_layers(pipeline, monkeypatch):
    """What bench pq compares with the cost model per stage: stage 0's Info and the later
    stages' StageInfo, each growing while a request runs through them."""
    from tessera.bench.pq_bench import stage_compute_s
    up, url = pipeline
    port = int(url.rsplit(":", 1)[1])
    before = stage_compute_s(port, len(STAGES), up.certs)
    chat(url, PROMPTS[0])
    after = stage_compute_s(port, len(STAGES), up.certs)
    assert all(t1 > t0 for t0, t1 in zip(before, after)), (before, after)


def test_a_stage_killed_mid_stream_fails_the_stream_then_the_pipeline_recovers(pipeline, expected):
    up, url = pipeline
    victim = up.pid("pipeline-shard-1")
    c = client(url)
    stream = c.chat.completions.create(model=c.models.list().data[0].id, stream=True, temperature=0, max_tokens=2000,
                                       messages=[{"role": "user", "content": "Go on forever."}],
                                       extra_body={"ignore_eos": True})
    t0 = None
    with pytest.raises(openai.APIError):
        for _ in stream:
            if t0 is None:
                os.kill(victim, signal.SIGKILL)
                t0 = time.monotonic()
    assert t0 is not None and time.monotonic() - t0 < 20   # the stage timeout (3 s) bounds it: no hang
    up.wait_for(r"pipeline-shard-1 \(pid \d+\) exited with signal SIGKILL; restarting in", 10)
    up.wait_for(r"tessera pipeline shard pipeline-shard-1 ready", 120, count=2)
    assert up.pid("pipeline-shard-1") != victim and len(up.pids("pipeline-shard-0")) == 1

    def answers() -> bool:   # the gateway skips stage 0 for a few seconds after its failure
        try:
            return chat(url, PROMPTS[0]) == expected[0]
        except openai.APIError:
            return False
    wait_until(answers, 60, "the pipeline never served again after the stage came back")

    # A stage that dies and comes back while nothing runs: stage 0 notices (it polls its
    # stages) and relinks before the next request, which succeeds at its first try.
    victim = up.pid("pipeline-shard-2")
    os.kill(victim, signal.SIGKILL)
    up.wait_for(r"tessera pipeline shard pipeline-shard-2 ready", 120, count=2)
    time.sleep(2)
    assert chat(url, PROMPTS[1]) == expected[1]


def test_a_stage_over_its_memory_budget_refuses_to_start(plan):
    out = subprocess.run([sys.executable, "-m", "tessera.cli", "pipeline-shard", "--model", MODEL, "--dtype",
                          "float32", "--quantization", plan, "--stage", "1", "--layers", "1:3", "--memory-gib",
                          "0.001", "--num-kv-blocks", "4096", "--port", str(low_ports(1))],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 78, out.stderr[-2000:]
    assert "stage 1 needs" in out.stderr and "more than its --memory-gib 0.001" in out.stderr, out.stderr[-2000:]
