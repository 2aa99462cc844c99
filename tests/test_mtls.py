"""Internal links are mutual TLS (mtls/): a worker started with a deployment certificate
serves the gateway's role only, refuses plaintext, a certificate of another CA and another
role of its own deployment (PERMISSION_DENIED), while its own certificate still probes it; a
client refuses a server whose certificate does not name the service it wants (a registry
record pointing at an expert node); the TCP M2N transport reads nothing from a dialer without
an M2N role's certificate, times out a handshake that never comes and caps how many wait."""
from __future__ import annotations

import asyncio
import os
import socket
import ssl
import struct
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health, health_pb2_grpc

from servers import tessera_grpc
from tessera import mtls
from tessera.config import SamplingParams
from tessera.mtls import links as ident_mod
from tessera.mtls.certs import make_ca, write_role_dirs
from tessera.rpc.client import GrpcWorkerClient
from tessera.rpc.expert_client import GrpcExpertControl
from tessera.transport import link
from tessera.transport import tcp as tcp_mod
from tessera.transport.base import DISPATCH, HEADER, Tag, TransportError
from tessera.transport.tcp import TcpTransport
from tessera.worker_api import GenerateInput, WorkerError


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """Role directories of deployment "test", and a gateway of another CA."""
    root = tmp_path_factory.mktemp("certs")
    dirs = write_role_dirs(root / "test", "test", ca=make_ca("test"))
    dirs["foreign-gateway"] = write_role_dirs(root / "other", "test", roles=("gateway",))["gateway"]
    return dirs


@pytest.fixture
def as_role(monkeypatch):
    """This test process holds the certificate of a role (or none)."""
    def use(directory) -> None:
        if directory is None:
            monkeypatch.delenv(mtls.ENV, raising=False)
        else:
            monkeypatch.setenv(mtls.ENV, str(directory))
    yield use
    ident_mod._cache.clear()


async def _ask(address: str) -> str:
    client = GrpcWorkerClient(address)
    try:
        text = ""
        async for chunk in client.generate(GenerateInput("tls-1", SamplingParams(max_tokens=3, temperature=0),
                                                         text="hello")):
            text += chunk.text
        return text
    finally:
        await client.close()


def test_worker_serves_the_gateway_role_only(tiny_models, certs, as_role):
    from tessera.entrypoints import probe
    env = dict(os.environ, **{mtls.ENV: str(certs["worker"])})
    with tessera_grpc("worker", "--model", tiny_models["llama"], "--dtype", "float32", "--num-kv-blocks", "32",
                      "--block-size", "8", env=env) as (address, _):
        as_role(None)
        assert probe.main(address, timeout_s=2) == 1            # plaintext: no handshake, no answer
        with pytest.raises(WorkerError):
            asyncio.run(_ask(address))
        as_role(certs["foreign-gateway"])                        # the right role, another CA
        with pytest.raises(WorkerError):
            asyncio.run(_ask(address))
        as_role(certs["expert-node"])                            # this CA, a role that may not call workers
        with pytest.raises(WorkerError, match="PERMISSION_DENIED|may not call"):
            asyncio.run(_ask(address))
        as_role(certs["worker"])
        assert probe.main(address) == 0                          # the container's own certificate probes
        as_role(certs["gateway"])
        assert asyncio.run(_ask(address))


def test_a_client_refuses_a_server_not_certified_for_the_service(certs, as_role):
    """An expert node's certificate (same CA) does not name the worker service: the gateway's
    client fails the handshake and sends no call."""
    as_role(certs["expert-node"])
    seen = []

    class Recording(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation, details):
            seen.append(details.method)
            return await continuation(details)

    async def run() -> None:
        server = grpc.aio.server(interceptors=[Recording()])
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
        port = mtls.add_port(server, "127.0.0.1", 0)
        await server.start()
        try:
            as_role(certs["gateway"])
            client = GrpcWorkerClient(f"127.0.0.1:{port}")
            with pytest.raises(WorkerError):
                await client.info()
            await client.close()
        finally:
            await server.stop(0)
    asyncio.run(run())
    assert seen == []


def test_expert_node_control_takes_attention_nodes_only(tiny_models, certs, as_role):
    env = dict(os.environ, **{mtls.ENV: str(certs["expert-node"])})
    with tessera_grpc("expert-node", "--model", tiny_models["llama"], "--dtype", "float32", "--threads", "1",
                      "--transport", "tcp", env=env) as (address, _):
        as_role(certs["gateway"])
        control = GrpcExpertControl(address)
        try:
            with pytest.raises(Exception, match="may not call"):
                control.info()
        finally:
            control.close()
        as_role(certs["attention-node"])
        control = GrpcExpertControl(address)
        try:
            assert control.info().expert_node == "expert-0"
        finally:
            control.close()


def test_a_certificate_that_cannot_work_stops_the_process_at_start(certs, tmp_path):
    """A key that is not the certificate's, or a certificate no CA in ca.crt issued: one line
    and exit 78 (a configuration error, never restarted), before any model is loaded."""
    import shutil
    import subprocess
    import sys
    for name, broken in (("key", "tls.key"), ("ca", "ca.crt")):
        d = tmp_path / name
        shutil.copytree(certs["worker"], d)
        shutil.copy(certs["foreign-gateway"] / broken, d / broken)
        out = subprocess.run([sys.executable, "-m", "tessera.cli", "worker", "--model", "random:llama"],
                             env=dict(os.environ, **{mtls.ENV: str(d)}), capture_output=True, text=True, timeout=120)
        assert out.returncode == 78 and "Traceback" not in out.stderr, out.stderr
        assert ("is not the key of" if name == "key" else "was not issued by a CA") in out.stderr


# ---- the TCP M2N transport --------------------------------------------------------------------

def _frame(tensor: torch.Tensor) -> bytes:
    from tessera.transport.base import pack_header, tensor_bytes
    return pack_header(Tag(0, 0, 0, DISPATCH), tensor, 0) + tensor_bytes(tensor).numpy().tobytes()


def _hello(name: str) -> bytes:
    return struct.pack("<B", len(name)) + name.encode()


def _wait_rejected(t: TcpTransport, n: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while t.rejected < n:
        assert time.monotonic() < deadline, f"{t.rejected} rejected, expected {n}"
        time.sleep(0.02)


def _answer(sock) -> bytes:
    """What the listener answers: b"" when it closed the link (a reset: closed with bytes unread)."""
    sock.settimeout(5)
    try:
        return sock.recv(1)
    except (ConnectionError, ssl.SSLError):
        return b""


def _tls_dial(t: TcpTransport, role_dir, payload: bytes) -> bytes:
    """Dial t over TLS holding role_dir's certificate, send payload; what t answers (b"": closed)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_cert_chain(role_dir / "tls.crt", role_dir / "tls.key")
    ctx.load_verify_locations(role_dir / "ca.crt")
    with socket.create_connection(t.address) as raw:
        try:
            with ctx.wrap_socket(raw, server_hostname="m2n.test.tessera") as s:
                s.sendall(payload)
                return _answer(s)
        except (ssl.SSLError, ConnectionError):
            return b""


def test_tcp_reads_nothing_from_a_dialer_without_an_m2n_certificate(certs, as_role):
    as_role(certs["attention-node"])
    e, a = TcpTransport("e"), TcpTransport("a")
    try:
        link(a, e)
        frame = _frame(torch.arange(4))
        with socket.create_connection(e.address) as raw:     # plaintext, an announced name
            raw.sendall(_hello("a") + frame)
            assert _answer(raw) == b""
        _wait_rejected(e, 1)
        assert _tls_dial(e, certs["gateway"], _hello("a") + frame) == b""          # a role without M2N
        _wait_rejected(e, 2)
        assert _tls_dial(e, certs["foreign-gateway"], _hello("a") + frame) == b""  # another CA
        _wait_rejected(e, 3)
        assert _tls_dial(e, certs["expert-node"], _hello("stranger") + frame) == b""   # M2N role, unannounced
        _wait_rejected(e, 4)
        with pytest.raises(TransportError):
            e.recv("a", Tag(0, 0, 0, DISPATCH), timeout_s=0.2)
        a.send("e", Tag(0, 0, 0, DISPATCH), torch.arange(4))    # the real peer still gets through
        assert torch.equal(e.recv("a", Tag(0, 0, 0, DISPATCH), timeout_s=5), torch.arange(4))
    finally:
        a.close()
        e.close()


def test_tcp_handshakes_time_out_and_are_capped(certs, as_role, monkeypatch):
    as_role(certs["attention-node"])
    monkeypatch.setattr(tcp_mod, "HANDSHAKE_S", 1.0)
    monkeypatch.setattr(tcp_mod, "MAX_HANDSHAKES", 2)
    e, a = TcpTransport("e"), TcpTransport("a")
    idle = []
    try:
        link(a, e)
        idle = [socket.create_connection(e.address) for _ in range(2)]   # connect, never speak
        time.sleep(0.2)
        with socket.create_connection(e.address) as third:            # over the cap: closed unread
            assert _answer(third) == b""
        _wait_rejected(e, 1)
        for s in idle:                                                 # the idle ones time out
            assert _answer(s) == b""
        _wait_rejected(e, 3)
        a.send("e", Tag(0, 0, 0, DISPATCH), torch.arange(4))
        assert torch.equal(e.recv("a", Tag(0, 0, 0, DISPATCH), timeout_s=5), torch.arange(4))
    finally:
        for s in idle:
            s.close()
        a.close()
        e.close()


def test_tcp_refuses_a_frame_larger_than_the_slot_before_reading_it(certs, as_role):
    as_role(certs["attention-node"])
    e, a = TcpTransport("e", capacity_bytes=1024), TcpTransport("a")
    try:
        link(a, e)
        huge = HEADER.pack(0, 0, 0, DISPATCH, 5, 1, 0, 1 << 40) + struct.pack("<q", 1 << 40)   # 1 TiB of uint8
        assert _tls_dial(e, certs["expert-node"], _hello("a") + huge) == b""
        _wait_rejected(e, 1)
        a.send("e", Tag(0, 0, 0, DISPATCH), torch.zeros(512, dtype=torch.float32))   # 2 KiB > 1 KiB slot
        _wait_rejected(e, 2)
        with pytest.raises(TransportError):
            e.recv("a", Tag(0, 0, 0, DISPATCH), timeout_s=0.2)
    finally:
        a.close()
        e.close()
