"""Attention-FFN disaggregation as real processes: expert nodes and attention nodes linked over
gRPC (control) and the M2N transport (tcp, and nixl where it imports). Greedy tokens equal to
the monolithic engine on the same float32 weights; an expert node that dies fails the
affected requests within a bounded time and the attention node serves again once it is back;
an expert node rejects malformed messages and keeps serving; `tessera up` runs a topology
file behind the gateway and answers like the monolithic engine."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import httpx
import pytest
import torch
import yaml

from servers import free_port, free_port_range, tessera_grpc, tessera_up, wait_until
from tessera.async_engine import AsyncEngine
from tessera.config import EngineConfig, SamplingParams
from tessera.disagg.control import ConnectRequest
from tessera.disagg.expert_shard import CONTROL_LAYER
from tessera.engine import Engine
from tessera.entrypoints.gateway.app import create_app
from tessera.local_client import LocalWorkerClient
from tessera.models.loader import model_id_for, resolve_model_path
from tessera.rpc.client import GrpcWorkerClient
from tessera.rpc.expert_client import GrpcExpertControl
from tessera.transport import make_transport, nixl, resolve_backend
from tessera.transport.base import COMBINE, DISPATCH, PeerError, Tag
from tessera.worker_api import GenerateInput, WorkerError

pytestmark = pytest.mark.e2e
TRANSPORTS = ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(not nixl.available(),
                                                                   reason="the nixl package does not import"))]
PROMPTS = [[1, 450, 3000, 17, 99, 4093], [2000, 5, 6, 7], [42, 42, 42, 31000, 12, 9, 77, 1000, 20000]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
MOE = "random:mixtral"   # 8 experts, top-2, created once in the cache


def expert_node(model: str, transport: str, index: int, count: int, port: int | None = None,
                experts: str | None = None):
    return tessera_grpc("expert-node", "--model", model, "--dtype", "float32", "--threads", "1",
                        "--name", f"expert-{index}", "--shard-index", str(index), "--shard-count", str(count),
                        "--transport", transport, *(["--experts", experts] if experts else []), port=port)


def attention_node(model: str, transport: str, index: int, m: int, experts: list[str], timeout_s: float = 10):
    flags = [a for address in experts for a in ("--expert", address)]
    return tessera_grpc("attention-node", "--model", model, "--dtype", "float32", "--threads", "1",
                        "--num-kv-blocks", "256", "--name", f"attention-{index}", "--transport", transport,
                        "--micro-batches", str(m), "--ffn-timeout-s", str(timeout_s), *flags)


@contextlib.contextmanager
def afd(model: str, transport: str, experts: int, micro_batches: tuple[int, ...]):
    """N expert nodes and one attention node per entry of micro_batches (its m)."""
    with contextlib.ExitStack() as stack:
        nodes = [stack.enter_context(expert_node(model, transport, i, experts))[0] for i in range(experts)]
        yield [stack.enter_context(attention_node(model, transport, j, m, nodes))[0]
               for j, m in enumerate(micro_batches)]


async def generate(address: str, prompts=PROMPTS, sampling: SamplingParams = GREEDY) -> list[list[int]]:
    client = GrpcWorkerClient(address, idle_timeout_s=120)

    async def one(prompt):
        ids = []
        async for chunk in client.generate(GenerateInput(uuid.uuid4().hex, sampling, token_ids=tuple(prompt))):
            ids.extend(chunk.token_ids)
        return ids
    try:
        return list(await asyncio.gather(*(one(p) for p in prompts)))
    finally:
        await client.close()


@pytest.fixture(scope="module")
def reference():
    """Greedy tokens of the monolithic engine, per model."""
    cache = {}

    def tokens(model: str):
        if model not in cache:
            resolve_model_path(model)
            cache[model] = Engine(EngineConfig(model=model, dtype="float32")).generate(PROMPTS, GREEDY)
        return cache[model]
    return tokens


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("model,experts", [(MOE, 1), (MOE, 2), ("smollm2", 2)])
def test_afd_processes_equal_monolithic(reference, transport, model, experts):
    expected = reference(model)
    with afd(model, transport, experts, micro_batches=(1, 3)) as attention:
        async def both():   # M = 2 attention nodes, at the same time, through the same experts
            return await asyncio.gather(*(generate(a) for a in attention))
        for got in asyncio.run(both()):
            assert got == expected


def test_afd_processes_with_interleaved_expert_sets(reference):
    """--experts 0,2,4,6 / 1,3,5,7: each expert node reports its set, the attention node
    routes by them, and the tokens equal the monolithic engine's."""
    with contextlib.ExitStack() as stack:
        nodes = [stack.enter_context(expert_node(MOE, "auto", i, 2, experts=spec))[0]
                 for i, spec in enumerate(["0,2,4,6", "1,3,5,7"])]
        attention = stack.enter_context(attention_node(MOE, "auto", 0, 2, nodes))[0]
        assert asyncio.run(generate(attention)) == reference(MOE)
        for address, held in zip(nodes, [(0, 2, 4, 6), (1, 3, 5, 7)]):
            control = GrpcExpertControl(address)
            try:
                info = control.info()
            finally:
                control.close()
            assert info.experts == held and info.tokens_in > 0


def test_expert_death_fails_requests_in_bounded_time_then_recovers(reference):
    transport = resolve_backend("auto")
    expected = reference(MOE)
    port = free_port()
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    with contextlib.ExitStack() as stack:
        _, proc = stack.enter_context(expert_node(MOE, transport, 0, 1, port=port))
        address = f"127.0.0.1:{port}"
        attention = stack.enter_context(attention_node(MOE, transport, 0, 2, [address], timeout_s=3))[0]
        assert asyncio.run(generate(attention)) == expected

        async def killed_mid_request():
            client = GrpcWorkerClient(attention, idle_timeout_s=60)
            t0 = None
            try:
                async for _ in client.generate(GenerateInput("long", long, token_ids=(1, 2, 3))):
                    if t0 is None:
                        proc.send_signal(signal.SIGKILL)
                        t0 = time.monotonic()
            except WorkerError as e:
                return time.monotonic() - t0, str(e)
            finally:
                await client.close()
            return None, "finished"
        elapsed, error = asyncio.run(killed_mid_request())
        assert elapsed is not None and elapsed < 15, error
        info = asyncio.run(_info(attention))   # the attention node itself stays up
        assert info.role == "attention"
        with expert_node(MOE, transport, 0, 1, port=port):   # back on the same address
            assert asyncio.run(generate(attention)) == expected
            _malformed_messages_are_rejected(address, transport)
            assert asyncio.run(generate(attention)) == expected


async def _info(address: str):
    client = GrpcWorkerClient(address)
    try:
        return await client.info()
    finally:
        await client.close()


def _malformed_messages_are_rejected(expert_address: str, backend: str):
    """A rogue attention-side endpoint sends a wrong-shaped message: an error reply comes back
    under the expected tag, the expert counts it, and keeps serving the real attention node."""
    control = GrpcExpertControl(expert_address)
    rogue = make_transport(backend, "rogue")
    try:
        info = control.info()
        reply = control.connect(ConnectRequest("rogue", backend, rogue.metadata_for(info.expert_node),
                                               info.model_id, 2))
        rogue.connect(reply.expert_node, reply.transport_metadata)
        rogue.send(info.expert_node, Tag(0, 0, CONTROL_LAYER, DISPATCH), torch.tensor([1.0]))
        rogue.send(info.expert_node, Tag(0, 0, 0, DISPATCH), torch.zeros(3, 17))
        with pytest.raises(PeerError):
            rogue.recv(info.expert_node, Tag(0, 0, 0, COMBINE), timeout_s=10)
        # the shard replies with the error before it counts the rejection
        wait_until(lambda: control.info().rejected == info.rejected + 1, 10, "the rejection counted")
    finally:
        rogue.close()
        control.close()


def test_tessera_up_dense_topology_answers_like_the_monolithic_engine(tmp_path, smollm2_engine):
    spec = yaml.safe_load(open("deploy/topologies/disagg-dense.yaml"))
    spec["dtype"] = "float32"
    for role in spec["roles"].values():
        role["port"] = free_port() if role["replicas"] == 1 else free_port_range(role["replicas"])
    topology = tmp_path / "dense.yaml"
    topology.write_text(yaml.safe_dump(spec))
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 12,
            "temperature": 0}

    async def ask(client: httpx.AsyncClient) -> str:
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    async def monolithic() -> str:
        engine = AsyncEngine(smollm2_engine)
        app = create_app(LocalWorkerClient(engine), "SmolLM2-135M-Instruct")
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
                return await ask(c)
        finally:
            engine.shutdown()

    expected = asyncio.run(monolithic())
    with tessera_up(str(topology)) as url:
        async def disaggregated() -> str:
            async with httpx.AsyncClient(base_url=url, timeout=120) as c:
                return await ask(c)
        assert asyncio.run(disaggregated()) == expected


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="bench afd pins its two processes to cores 0 and 1")
def test_bench_afd_json_rows_with_simulation():
    """`tessera bench afd --json` prints only JSON: the monolithic row, one row per m, each
    with the simulator's prediction from the m = 1 calibration runs (tiny model, few steps:
    a check of the output, not of the speed)."""
    out = subprocess.run([sys.executable, "-m", "tessera.cli", "bench", "afd", "--json", "--model", MOE,
                          "--batch", "4", "--prompt-len", "4", "--steps", "3", "--micro-batches", "1,2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout)
    assert [r["mode"] for r in rows] == ["monolithic", "afd", "afd"]
    assert [r["micro_batches"] for r in rows[1:]] == [1, 2]
    for r in rows[1:]:
        assert r["output_tok_s"] > 0 and r["t_e_ms"] > 0 and r["simulated_ms"] > 0
        assert 0 <= r["attention_idle"] <= 1 and 0 <= r["expert_idle"] <= 1
