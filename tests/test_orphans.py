"""No process of `tessera up` / `tessera serve` outlives its supervisor, whatever kills the
supervisor and whenever: SIGKILLed in the middle of starting a child (the window between the
fork and the child being tied to its parent, widened here), or leaving behind a child whose
drain never ends, or SIGKILLed while `tessera up` restarts a worker. An orphan is looked for by
pid (a zombie no one reaps counts as gone) and by the ports it would hold."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import yaml

from servers import Logged, free_port, free_port_range, wait_until

SUPERVISE = """
import json, os, sys, time
from tessera.deploy import supervisor as s
spec = json.loads(sys.argv[1])
if spec.get("slow_fork"):   # the child writes its pid and lingers between fork and being tied to us
    tie = s._die_with_parent
    def slow(*args):
        open(spec["slow_fork"], "w").write(str(os.getpid()))
        time.sleep(1.0)
        tie(*args)
    s._die_with_parent = slow
children = [s.Child(name, "worker", argv) for name, argv in spec["children"]]
s.Supervisor(children, s.SupervisorConfig(shutdown_grace_s=spec["grace"]), "supervisor").run()
"""


def alive(pid: int) -> bool:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def kill_if_alive(pids) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def supervise(children: list[tuple[str, list[str]]], grace_s: float, **extra) -> subprocess.Popen:
    """A Supervisor in a process of its own, for the test to SIGKILL; its log on stdout."""
    spec = json.dumps({"children": children, "grace": grace_s, **extra})
    return subprocess.Popen([sys.executable, "-c", SUPERVISE, spec], stdout=subprocess.PIPE, text=True)


def test_a_child_whose_supervisor_dies_while_starting_it_does_not_live_on(tmp_path):
    forked = tmp_path / "forked"
    sup = supervise([("worker-0", [sys.executable, "-c", "import time; time.sleep(60)"])], 1,
                    slow_fork=str(forked))
    child = None
    try:
        wait_until(lambda: forked.exists() and forked.read_text(), 30, "the supervisor never forked")
        child = int(forked.read_text())
        sup.kill()                 # between the fork and the child's tie to its parent
        sup.wait()
        wait_until(lambda: not alive(child), 5, "the child outlived the supervisor that was starting it")
    finally:
        sup.kill()
        kill_if_alive([child] if child else [])


HUNG_DRAIN = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: print("draining", flush=True))   # a drain that never ends
from tessera.deploy.parent_watch import watch_from_env
print("watching" if watch_from_env() else "not watching", flush=True)
time.sleep(120)
"""


def test_an_orphan_whose_drain_never_ends_exits_after_its_grace_period(tmp_path):
    grace_s = 1.0
    out = tmp_path / "child.out"
    sup = supervise([("worker-0", ["sh", "-c", f'exec {sys.executable} -c "$0" >{out} 2>&1', HUNG_DRAIN])], grace_s)
    child = None
    try:
        child = int(sup.stdout.readline().split("worker-0 pid ")[1])
        wait_until(lambda: out.exists() and out.read_text().strip(), 30, "the child never started")
        assert out.read_text().strip() == "watching"
        sup.kill()
        sup.wait()
        t0 = time.monotonic()
        wait_until(lambda: not alive(child), grace_s + 5 + 3, "an orphan whose drain hangs lived on")
        assert time.monotonic() - t0 > grace_s          # its drain had its grace period
        lines = out.read_text().splitlines()
        assert lines[:2] == ["watching", "draining"]     # the supervisor's death began the drain
        assert f"the supervisor (pid {sup.pid}) is gone and the drain did not end" in lines[-1]
    finally:
        sup.kill()
        kill_if_alive([child] if child else [])


def _port_free(port: int) -> bool:
    """A server could listen there again (SO_REUSEADDR, as servers set: connections in
    TIME_WAIT do not hold it, a listener does)."""
    import socket
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.mark.e2e
def test_up_sigkilled_while_restarting_a_worker_leaves_no_process_and_no_port(tmp_path):
    grace_s = 3
    worker_port, port = free_port_range(2), free_port()
    topology = tmp_path / "tiny.yaml"
    topology.write_text(yaml.safe_dump({
        "name": "orphans", "model": "random:llama", "dtype": "float32",
        "roles": {"redis": {"port": 6379}, "worker": {"replicas": 2, "port": worker_port, "threads": 1},
                  "gateway": {"replicas": 1, "port": port}}}))
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    up = Logged("up", str(topology), "--port", str(port), "--restart-backoff-s", "0.2",
                "--shutdown-grace-s", str(grace_s), env=env)
    pids = []
    try:
        for i in range(2):
            up.wait_for(rf"tessera worker ready on 127.0.0.1:{worker_port + i}", 240)
        redis_port = int(up.wait_for(r"tessera up: registry redis://[^:]*:(\d+)")[1])
        try:
            os.kill(up.pid("worker-0"), signal.SIGKILL)
        except ProcessLookupError:
            pytest.fail("worker-0 exited on its own before the test killed it:\n" + "\n".join(up.lines[-60:]))
        up.wait_for(r"worker-0 pid \d+ \(restart 1\)", 10)
        up.proc.kill()             # the new worker-0 is starting
        up.proc.wait()
        pids = [up.pid(name) for name in ("redis-0", "worker-0", "worker-1", "gateway-0")]
        wait_until(lambda: not any(map(alive, pids)), grace_s + 5, f"processes outlived `tessera up`: "
                   f"{[p for p in pids if alive(p)]}")
        ports = [worker_port, worker_port + 1, port, redis_port]
        wait_until(lambda: all(map(_port_free, ports)), 5, f"ports still held: {[p for p in ports if not _port_free(p)]}")
    finally:
        up.close()
        kill_if_alive(pids)
