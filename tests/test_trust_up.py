"""`tessera up` against someone who can write the deployment's Redis (holding its password, as
after a Redis compromise): worker records pointing at a listener of theirs, and at a process
holding another role's certificate of the same CA, get no request and no credential, and every
user request still succeeds. No secret (Redis password, key) shows on a command line or in
`tessera up`'s output."""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import socket
import ssl
import subprocess
import sys
import threading

import openai
import pytest
import yaml

from servers import Logged, free_port, redis_server, wait_until
from tessera.mtls.certs import write_role_dirs

PASSWORD = "trust-test-redis-pw"
PROMPT = "Tell me about the harbour at dawn."


class Listener:
    """A plain TCP listener that keeps every byte it is sent (then closes the connection)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port, self.received, self.connections = self.sock.getsockname()[1], bytearray(), 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.settimeout(2.0)
            try:
                with self._open(conn) as stream:
                    while chunk := stream.recv(65536):
                        self.received += chunk
            except OSError:      # ssl.SSLError too
                conn.close()

    def _open(self, conn: socket.socket) -> socket.socket:
        return conn


def _cmdlines() -> list[str]:
    out = []
    for d in pathlib.Path("/proc").iterdir():
        try:
            out.append((d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return out


async def _plant(redis_url: str, prefix: str, addresses: list[str]) -> None:
    """Copy the real worker's record under new ids (no expiry), pointing at `addresses`, with no
    load (so a least-loaded gateway would pick them first); and a value that is no record at all."""
    import redis.asyncio as redis
    client = redis.Redis.from_url(redis_url)
    try:
        (key,) = [k async for k in client.scan_iter(match=f"{prefix}:worker:*")]
        record = json.loads(await client.get(key))
        for i, address in enumerate(addresses):
            await client.set(f"{prefix}:worker:rogue-{i}", json.dumps({**record, "worker_id": f"rogue-{i}",
                                                                       "address": address, "load": 0}))
        await client.set(f"{prefix}:worker:garbage", b"\x00not json")    # must not stop the watch
    finally:
        await client.aclose()


@pytest.mark.e2e
def test_a_planted_worker_record_gets_no_request_and_users_are_served(tiny_models, tmp_path):
    topology = tmp_path / "trust.yaml"
    port, worker_port = free_port(), free_port()
    topology.write_text(yaml.safe_dump({"name": "trust", "model": tiny_models["llama"], "dtype": "float32", "roles": {
        "redis": {"port": 6379}, "worker": {"replicas": 1, "port": worker_port, "num_kv_blocks": 64},
        "gateway": {"port": port}}}))
    certs = tmp_path / "certs"
    subprocess.run([sys.executable, "-m", "tessera.cli", "certs", str(topology), "--out", str(certs)], check=True)
    # An insider: a certificate of this very CA, for a role that does not serve the Worker service.
    ca = ((certs / "ca" / "ca.crt").read_bytes(), (certs / "ca" / "ca.key").read_bytes())
    insider = Insider(write_role_dirs(tmp_path / "insider", "trust", roles=("expert-node",), ca=ca)["expert-node"])
    outsider = Listener()
    with redis_server(password=PASSWORD) as redis:
        up = Logged("up", str(topology), "--certs", str(certs), "--shutdown-grace-s", "2",
                    env=dict(os.environ, REDIS_URL=redis.url))
        try:
            up.wait_for("tessera worker ready", 120)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                   timeout=60)
            wait_until(lambda: _answers(client), 120, "the gateway never answered")
            assert not [c for c in _cmdlines() if PASSWORD in c]                      # not in `ps`
            assert not [line for line in up.lines if PASSWORD in line]              # not in the output
            asyncio.run(_planted_and_served(insider, outsider, redis.url, client))
        finally:
            assert up.close(60) == 0
    assert insider.connections >= 1 and insider.received == b""        # dialed, refused, read nothing
    assert PROMPT.encode() not in outsider.received                     # no prompt, in clear or otherwise
    assert outsider.received[:1] == b"\x16"      # the gateway did dial it: a TLS ClientHello, nothing more
    assert b"PRI * HTTP/2.0" not in outsider.received                   # no gRPC (HTTP/2) ever began


class Insider(Listener):
    """A TLS listener holding another role's certificate of the deployment's own CA: it counts
    the connections it gets and keeps whatever a completed handshake would let it read."""

    def __init__(self, role_dir: pathlib.Path) -> None:
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(role_dir / "tls.crt", role_dir / "tls.key")
        self.ctx.load_verify_locations(role_dir / "ca.crt")
        self.ctx.verify_mode = ssl.CERT_REQUIRED
        super().__init__()

    def _open(self, conn: socket.socket) -> socket.socket:
        return self.ctx.wrap_socket(conn, server_side=True)


async def _planted_and_served(insider: Insider, outsider: Listener, redis_url: str, client) -> None:
    """Plant both records, then send users' requests."""
    await _plant(redis_url, "tessera:trust", [f"127.0.0.1:{insider.port}", f"127.0.0.1:{outsider.port}"])
    await asyncio.sleep(2.0)      # the gateway's registry watch picks them up
    model = client.models.list().data[0].id
    for _ in range(2):    # at once: the real worker busy, a least-loaded pick goes to the planted ones
        replies = await asyncio.gather(*(asyncio.to_thread(
            client.chat.completions.create, model=model, max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": f"{PROMPT} ({i})"}]) for i in range(8)))
        assert all(r.choices[0].message.content is not None for r in replies)


def _answers(client) -> bool:
    try:
        return bool(client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=2,
                                                   messages=[{"role": "user", "content": "hi"}]).choices)
    except openai.OpenAIError:
        return False
