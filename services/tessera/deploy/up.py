"""`tessera up FILE`: run every process of a topology on this machine and supervise them:
if one exits, or on Ctrl-C / SIGTERM, all are stopped (terminate, then kill after 10 s)."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

from tessera.deploy.topology import Topology


def tessera_argv(args) -> list[str]:
    return [sys.executable, "-m", "tessera.cli", *args]


def up(topology: Topology) -> int:
    from tessera.models.loader import resolve_model_path
    resolve_model_path(topology.model)   # fail early; a random:ARCH model is created once, here
    procs = []
    for p in topology.processes():
        print(f"tessera up: {p.name} on port {p.port}: tessera {' '.join(p.argv)}", flush=True)
        procs.append(subprocess.Popen(tessera_argv(p.argv)))
    return supervise(procs)


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
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
