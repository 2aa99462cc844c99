"""`tessera up FILE`: run every process of a topology on this machine and supervise them:
if one exits, or on Ctrl-C / SIGTERM, all are stopped (terminate, then kill after 10 s).
A `redis` role uses the Redis at $REDIS_URL when set, else a redis-server started here on a
free port (no persistence)."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

from tessera.config import ConfigError
from tessera.deploy.topology import LOCAL, Topology


def tessera_argv(args) -> list[str]:
    return [sys.executable, "-m", "tessera.cli", *args]


def up(topology: Topology) -> int:
    from tessera.models.loader import resolve_model_path
    resolve_model_path(topology.model)   # fail early; a random:ARCH model is created once, here
    procs, place = [], LOCAL
    with tempfile.TemporaryDirectory(prefix="tessera-up-") as scratch:
        if topology.registry:
            url = os.environ.get("REDIS_URL")
            if not url:
                redis, url = _start_redis(scratch)
                procs.append(redis)
            print(f"tessera up: registry {url}", flush=True)
            place = replace(LOCAL, redis_url=url)
        for p in topology.processes(place):
            if p.role == "redis":
                continue
            print(f"tessera up: {p.name} on port {p.port}: tessera {' '.join(p.argv)}", flush=True)
            procs.append(subprocess.Popen(tessera_argv(p.argv)))
        return supervise(procs)


def _start_redis(scratch: str) -> tuple[subprocess.Popen, str]:
    server = shutil.which("redis-server")
    if server is None:
        raise ConfigError("the topology has a redis role: set REDIS_URL or install redis-server")
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", scratch], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        with contextlib.closing(socket.socket()) as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"redis://127.0.0.1:{port}/0"
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise ConfigError(f"redis-server did not start on port {port}")
        time.sleep(0.1)


def supervise(procs: list[subprocess.Popen]) -> int:
    """Wait until one process exits or we are interrupted; then stop them all."""
    def interrupt(*_):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupt)
    try:
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        return next(p.returncode for p in procs if p.poll() is not None) or 1
    except KeyboardInterrupt:
        return 0
    finally:
        stop(procs)


def stop(procs: list[subprocess.Popen], timeout_s: float = 10.0) -> None:
    """SIGTERM in reverse start order (gateway first, Redis last: workers deregister on the
    way out), then SIGKILL whatever has not exited within timeout_s."""
    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
