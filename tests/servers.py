"""Start real `tessera` processes for end-to-end tests, on free ports, and stop them."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def tessera_serve(*args: str, timeout_s: float = 180.0):
    """`tessera serve ARGS` on free ports; yields the gateway's base URL once /health passes."""
    port, worker_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "tessera.cli", "serve", "--port", str(port),
           "--worker-port", str(worker_port), *args]
    proc = subprocess.Popen(cmd, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tessera serve exited with {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=30).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("tessera serve did not become healthy")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextlib.contextmanager
def tessera_worker(*args: str, timeout_s: float = 180.0):
    """`tessera worker ARGS` on a free port; yields its address once grpc.health.v1 says SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tessera.cli", "worker", "--port", str(port), *args])
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"tessera worker exited with {proc.returncode}")
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                            health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError("tessera worker did not become healthy")
                time.sleep(0.5)
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
