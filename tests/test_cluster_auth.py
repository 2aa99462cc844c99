"""The cluster secret (cluster_auth.py): a worker and an expert node started with
--cluster-secret-file refuse internal calls without the token (UNAUTHENTICATED, which the
gateway's client turns into an error, never data) and serve them with it, while grpc.health.v1
still answers probes; the TCP M2N transport drops a link from a peer the control plane did not
announce, or without the secret's proof, and a frame larger than the receiving slot."""
from __future__ import annotations

import asyncio
import socket
import struct
import time

import pytest
import torch

from servers import tessera_grpc
from tessera import cluster_auth
from tessera.config import SamplingParams
from tessera.disagg.control import ConnectRequest
from tessera.entrypoints import probe
from tessera.rpc.client import GrpcWorkerClient
from tessera.rpc.expert_client import GrpcExpertControl
from tessera.transport import link
from tessera.transport.base import DISPATCH, HEADER, Tag, TransportError
from tessera.transport.tcp import TcpTransport
from tessera.worker_api import GenerateInput, WorkerError

SECRET = "s3cret-for-tests"


@pytest.fixture
def secret_file(tmp_path, monkeypatch):
    """A secret file for the server; this process (the client) starts without the secret."""
    monkeypatch.delenv(cluster_auth.ENV, raising=False)
    path = tmp_path / "cluster-secret"
    path.write_text(SECRET + "\n")
    return str(path)


async def _ask(address: str) -> tuple[str, str]:
    client = GrpcWorkerClient(address)
    try:
        info = await client.info()
        text = ""
        async for chunk in client.generate(GenerateInput("auth-1", SamplingParams(max_tokens=3, temperature=0),
                                                         text="hello")):
            text += chunk.text
        return info.model_id, text
    finally:
        await client.close()


def test_worker_serves_only_calls_with_the_cluster_token(tiny_models, secret_file, monkeypatch):
    with tessera_grpc("worker", "--model", tiny_models["llama"], "--dtype", "float32", "--num-kv-blocks", "32",
                      "--block-size", "8", "--cluster-secret-file", secret_file) as (address, _):
        assert probe.main(address) == 0          # health answers without the token (tessera_grpc too)
        with pytest.raises(WorkerError, match="UNAUTHENTICATED"):
            asyncio.run(_ask(address))
        monkeypatch.setenv(cluster_auth.ENV, "not-the-secret")
        with pytest.raises(WorkerError, match="UNAUTHENTICATED"):
            asyncio.run(_ask(address))
        monkeypatch.setenv(cluster_auth.ENV, SECRET)
        model_id, text = asyncio.run(_ask(address))
        assert model_id and text


def test_expert_node_refuses_connect_without_the_cluster_token(tiny_models, secret_file, monkeypatch):
    with tessera_grpc("expert-node", "--model", tiny_models["llama"], "--dtype", "float32", "--threads", "1",
                      "--transport", "tcp", "--cluster-secret-file", secret_file) as (address, _):
        assert probe.main(address) == 0
        control = GrpcExpertControl(address)
        rogue = TcpTransport("rogue")
        try:
            request = ConnectRequest("rogue", "tcp", rogue.metadata_for("expert-0"), "any", 2)
            with pytest.raises(Exception, match="cluster token"):
                control.connect(request)
            with pytest.raises(Exception, match="cluster token"):
                control.info()
            monkeypatch.setenv(cluster_auth.ENV, SECRET)
            assert control.info().expert_node == "expert-0"
        finally:
            rogue.close()
            control.close()


def _wait_rejected(t: TcpTransport, n: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while t.rejected < n:
        assert time.monotonic() < deadline, f"{t.rejected} rejected, expected {n}"
        time.sleep(0.02)


def _frame(tensor: torch.Tensor) -> bytes:
    from tessera.transport.base import pack_header, tensor_bytes
    return pack_header(Tag(0, 0, 0, DISPATCH), tensor, 0) + tensor_bytes(tensor).numpy().tobytes()


def _raw_link(t: TcpTransport, name: str, proof: bytes, payload: bytes) -> bytes:
    """Dial t as `name`, send the hello and payload; what t answers (b"": it closed the link)."""
    with socket.create_connection(t.address) as raw:
        raw.sendall(struct.pack("<H", len(name)) + name.encode() + proof + payload)
        raw.settimeout(5)
        try:
            return raw.recv(1)
        except ConnectionResetError:   # closed with our bytes unread
            return b""


def test_tcp_drops_links_from_unannounced_or_unauthenticated_peers(monkeypatch):
    monkeypatch.setenv(cluster_auth.ENV, SECRET)
    e, a = TcpTransport("e"), TcpTransport("a")
    try:
        link(a, e)
        frame = _frame(torch.arange(4))
        stranger = cluster_auth.peer_proof("stranger", "e")     # knows the secret, never announced
        assert _raw_link(e, "stranger", stranger, frame) == b""
        _wait_rejected(e, 1)
        assert _raw_link(e, "a", bytes(cluster_auth.PROOF_SIZE), frame) == b""   # announced name, no proof
        _wait_rejected(e, 2)
        with pytest.raises(TransportError):
            e.recv("stranger", Tag(0, 0, 0, DISPATCH), timeout_s=0.2)
        with pytest.raises(TransportError):
            e.recv("a", Tag(0, 0, 0, DISPATCH), timeout_s=0.2)
        a.send("e", Tag(0, 0, 0, DISPATCH), torch.arange(4))    # the real peer still gets through
        assert torch.equal(e.recv("a", Tag(0, 0, 0, DISPATCH), timeout_s=5), torch.arange(4))
    finally:
        a.close()
        e.close()


def test_tcp_refuses_a_frame_larger_than_the_slot_before_reading_it():
    e, a = TcpTransport("e", capacity_bytes=1024), TcpTransport("a")
    try:
        link(a, e)
        huge = HEADER.pack(0, 0, 0, DISPATCH, 5, 1, 0, 1 << 40) + struct.pack("<q", 1 << 40)   # 1 TiB of uint8
        assert _raw_link(e, "a", cluster_auth.peer_proof("a", "e"), huge) == b""
        _wait_rejected(e, 1)
        a.send("e", Tag(0, 0, 0, DISPATCH), torch.zeros(512, dtype=torch.float32))   # 2 KiB > 1 KiB slot
        _wait_rejected(e, 2)
        with pytest.raises(TransportError):
            e.recv("a", Tag(0, 0, 0, DISPATCH), timeout_s=0.2)
    finally:
        a.close()
        e.close()
