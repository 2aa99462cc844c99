"""Start real `tessera` processes for end-to-end tests, on free ports, and stop them."""
from __future__ import annotations

import contextlib
import os
import pathlib
import socket
import subprocess
import sys
import time
from typing import Callable

import httpx
import yaml


def wait_until(predicate, timeout_s: float, what: str) -> None:
    """Poll predicate() every 0.2 s; fail with `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_range(n: int) -> int:
    """A port p with p .. p + n - 1 all free (replica i listens on p + i)."""
    while True:
        p = free_port()
        if p + n < 65535 and all(_is_free(p + i) for i in range(n)):
            return p


def _is_free(port: int) -> bool:
    with contextlib.closing(socket.socket()) as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@contextlib.contextmanager
def _process(args: list[str], ready: Callable[[], bool], timeout_s: float, stderr=None, env=None):
    """`python -m tessera.cli ARGS` until ready() is true; terminated (then killed) on exit."""
    proc = subprocess.Popen([sys.executable, "-m", "tessera.cli", *args],
                            env=dict(env or os.environ, TOKENIZERS_PARALLELISM="false"), stderr=stderr)
    try:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if proc.poll() is not None:
                raise RuntimeError(f"tessera {args[0]} exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"tessera {args[0]} did not become ready")
            time.sleep(0.5)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def _http_ok(url: str, timeout_s: float) -> bool:
    try:
        return httpx.get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def tessera_serve(*args: str, timeout_s: float = 180.0):
    """`tessera serve ARGS` on free ports; yields the gateway's base URL once /health passes."""
    port, worker_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    with _process(["serve", "--port", str(port), "--worker-port", str(worker_port), *args],
                  lambda: _http_ok(url + "/health", 30), timeout_s):
        yield url


@contextlib.contextmanager
def tessera_gateway(*args: str, timeout_s: float = 180.0):
    """`tessera gateway ARGS` on a free port; yields (base URL, process) once /health/ready passes."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with _process(["gateway", "--port", str(port), "--wait-s", "120", *args],
                  lambda: _http_ok(url + "/health/ready", 10), timeout_s) as proc:
        yield url, proc


@contextlib.contextmanager
def tessera_grpc(command: str, *args: str, port: int | None = None, timeout_s: float = 180.0, stderr=None,
                 env: dict | None = None):
    """`tessera COMMAND --port P ARGS` (a worker, attention node or expert node); yields
    (address, process) once grpc.health.v1 says SERVING (asked with the process's own
    certificate when env gives it one: TESSERA_TLS_DIR)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tessera import mtls
    from tessera.mtls.links import load
    from tessera.mtls.names import SERVES
    address = f"127.0.0.1:{port or free_port()}"
    own = load(env[mtls.ENV]) if env and env.get(mtls.ENV) else None
    channel = mtls.channel(address, SERVES[own.role][0], ident=own) if own else grpc.insecure_channel(address)
    stub = health_pb2_grpc.HealthStub(channel)

    def serving() -> bool:
        try:
            return stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    try:
        with _process([command, "--port", address.rsplit(":", 1)[1], *args], serving, timeout_s, stderr,
                      env) as proc:
            yield address, proc
    finally:
        channel.close()


def tessera_worker(*args: str, timeout_s: float = 180.0):
    """`tessera worker ARGS` on a free port; yields (address, process) once SERVING."""
    return tessera_grpc("worker", *args, timeout_s=timeout_s)


@contextlib.contextmanager
def tessera_up(topology: str, timeout_s: float = 240.0, env: dict | None = None):
    """`tessera up TOPOLOGY`; yields the gateway's base URL once /health passes."""
    import yaml
    url = f"http://127.0.0.1:{yaml.safe_load(open(topology))['roles']['gateway']['port']}"
    with _process(["up", topology], lambda: _http_ok(url + "/health", 30), timeout_s, env=env):
        yield url


class RedisServer:
    """A redis-server of our own on a fixed free port that a test can stop and start again."""

    def __init__(self, tmp: str, password: str | None = None) -> None:
        import shutil
        self.server = shutil.which("redis-server")
        if self.server is None:
            raise RuntimeError("install redis-server")
        self.port, self.tmp, self.proc, self.password = free_port(), tmp, None, password
        auth = f":{password}@" if password else ""
        self.url = f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        # the password as config on stdin ("-"), never on a command line
        self.proc = subprocess.Popen([self.server, "-", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", self.tmp], stdout=subprocess.DEVNULL,
                                     stdin=subprocess.PIPE)
        self.proc.stdin.write(f"requirepass {self.password}\n".encode() if self.password else b"")
        self.proc.stdin.close()
        deadline = time.monotonic() + 10
        while True:
            with contextlib.closing(socket.socket()) as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError("redis-server did not start")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


@contextlib.contextmanager
def redis_server(password: str | None = None):
    """A RedisServer, started; stopped on exit."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(tmp, password)
        server.start()
        try:
            yield server
        finally:
            server.stop()


@contextlib.contextmanager
def redis_url():
    """$REDIS_URL when set, else a redis-server of our own on a free port (no persistence)."""
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    with redis_server() as server:
        yield server.url


class Logged:
    """`tessera ARGS` with its output and its children's (stdout and stderr) collected line by
    line, for tests that follow a supervisor's "NAME pid PID" and restart lines."""

    def __init__(self, *args: str, env: dict | None = None) -> None:
        import threading
        self.args, self.lines = args, []
        self.proc = subprocess.Popen([sys.executable, "-m", "tessera.cli", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     env=dict(env or os.environ, TOKENIZERS_PARALLELISM="false"))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout_s: float = 120.0, count: int = 1):
        """The count-th line matching the regex (re.search), waiting for it."""
        import re
        deadline = time.monotonic() + timeout_s
        while True:
            found = [m for m in map(re.compile(pattern).search, list(self.lines)) if m]
            if len(found) >= count:
                return found[count - 1]
            # gone: exited, and every line it wrote read (the reader stops at the pipe's end)
            gone = self.proc.poll() is not None and not self._reader.is_alive()
            if time.monotonic() > deadline or (gone and not found):
                raise TimeoutError(f"no {pattern!r} (x{count}) from tessera {self.args[0]}:\n" +
                                   "\n".join(self.lines[-40:]))
            time.sleep(0.1)

    def pid(self, name: str) -> int:
        """The pid of the latest start of process NAME."""
        self.wait_for(rf": {name} pid (\d+)")
        return self.pids(name)[-1]

    def redis_url(self) -> str:
        """The registry URL of the Redis `tessera up` started, with its password: read from that
        redis-server's config file (private to this user), as the same user on the host could."""
        url = self.wait_for(r"tessera up: registry (\S+)")[1]
        # redis-server runs in up's scratch once it has read its --dir: a just-restarted one may not yet
        conf = pathlib.Path(f"/proc/{self.pid('redis-0')}/cwd/redis.conf")
        wait_until(conf.exists, 10, f"redis-0 never moved to the directory of its config file ({conf})")
        password = next(line.split(None, 1)[1].strip() for line in open(conf) if line.startswith("requirepass "))
        return url.replace("redis://", f"redis://:{password}@", 1)

    def pids(self, name: str) -> list[int]:
        """Every pid process NAME has had, in start order."""
        import re
        return [int(m[1]) for m in map(re.compile(rf": {name} pid (\d+)").search, list(self.lines)) if m]

    def close(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def tiny_topology(name: str, models: dict, tmp_path: pathlib.Path) -> pathlib.Path:
    """deploy/topologies/NAME.yaml on free ports and a tiny random model (two layers)."""
    spec = yaml.safe_load((pathlib.Path(__file__).resolve().parents[1] / f"deploy/topologies/{name}.yaml").read_text())
    spec.update(model=models["mixtral" if name == "disagg-moe" else "llama"], dtype="float32")
    for role_name, role in spec["roles"].items():
        role["port"] = free_port_range(len(role.get("stages", ())) or role.get("replicas", 1))
        if role_name == "draft_worker":
            role["speculative"] = "self:1"
        if role_name == "pipeline_shard":
            role["stages"] = [dict(s, layers=layers) for s, layers in zip(role["stages"], ("0:1", "1:2"))]
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path
