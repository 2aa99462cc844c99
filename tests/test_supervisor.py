"""The restart policy of `tessera up` / `tessera serve`, on tiny fake processes: restarts with
exponential backoff, giving up on a process that keeps dying (exit 1 only when no replica of a
serving role is left), giving up at once on one that ends with a configuration error,
draining last-started role first, and SIGKILL after the grace period. Then through `tessera up`:
a worker whose port is taken is reported once and not restarted."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import yaml

from servers import Logged, free_port
from tessera.deploy.supervisor import Child, Supervisor, SupervisorConfig, stop

FAST = SupervisorConfig(max_restarts=2, restart_window_s=30, restart_backoff_s=0.05, max_restart_backoff_s=0.1,
                        shutdown_grace_s=2)


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


CRASH = python("import sys; sys.exit(3)")
SLEEP = python("import time; time.sleep(60)")
# What `tessera` ends with on a configuration error (exit_codes.CONFIG_ERROR, sysexits' EX_CONFIG).
MISCONFIGURED = python("import sys; print('tessera worker: error: no such architecture', file=sys.stderr); sys.exit(78)")


def on_sigterm(path, word: str, delay_s: float = 0.0) -> list[str]:
    """A process that, on SIGTERM, waits delay_s (a drain) and appends `word` to path."""
    return python(f"import signal, sys, time\n"
                  f"def bye(*_):\n    time.sleep({delay_s}); open({str(path)!r}, 'a').write({word!r} + ' '); sys.exit(0)\n"
                  f"signal.signal(signal.SIGTERM, bye)\nwhile True: time.sleep(1)")


def test_backoff_doubles_up_to_its_cap():
    config = SupervisorConfig(restart_backoff_s=0.5, max_restart_backoff_s=3)
    assert [config.backoff(n) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3, 3]


def test_a_role_that_keeps_crashing_is_given_up_and_the_exit_code_says_so(capsys):
    children = [Child("worker-0", "worker", CRASH), Child("gateway-0", "gateway", SLEEP)]
    t0 = time.monotonic()
    assert Supervisor(children, FAST, "tessera up").run() == 1
    assert time.monotonic() - t0 < 10
    out = capsys.readouterr().out
    assert out.count("tessera up: worker-0 pid") == 3          # started, restarted twice
    assert "worker-0 pid" in out and "(restart 2)" in out and "(restart 3)" not in out
    assert "exited with code 3; restarting in 0.1 s" in out
    assert "giving up on worker-0: it exited 3 times within 30 s (last: code 3)" in out
    assert "no worker left; stopping" in out
    assert children[1].proc.poll() is not None                 # the others were stopped too


def test_losing_one_replica_or_a_helper_keeps_the_rest_serving_and_drains_in_order(tmp_path, capsys):
    order = tmp_path / "order"
    children = [Child("redis-0", "redis", CRASH, essential=False),
                Child("worker-0", "worker", CRASH),
                Child("worker-1", "worker", on_sigterm(order, "worker")),
                Child("gateway-0", "gateway", on_sigterm(order, "gateway", delay_s=0.5))]
    supervisor = Supervisor(children, FAST, "tessera up")
    threading.Timer(5.0, supervisor.request_stop).start()
    assert supervisor.run() == 0
    out = capsys.readouterr().out
    assert "giving up on redis-0" in out and "giving up on worker-0" in out and "left; stopping" not in out
    assert "draining" in out
    assert order.read_text().split() == ["gateway", "worker"]   # the gateway drained before the workers stopped
    assert children[2].proc.returncode == 0 and children[3].proc.returncode == 0


def test_a_configuration_error_is_reported_once_and_ends_the_role_without_a_restart(capsys):
    children = [Child("worker-0", "worker", MISCONFIGURED), Child("gateway-0", "gateway", SLEEP)]
    t0 = time.monotonic()
    assert Supervisor(children, FAST, "tessera up").run() == 1
    assert time.monotonic() - t0 < 5
    out, err = capsys.readouterr()
    assert out.count("worker-0 pid") == 1 and "restarting" not in out
    assert out.count("giving up on worker-0: it exited with a configuration error (code 78") == 1
    assert "no worker left; stopping" in out
    assert children[1].proc.poll() is not None


def test_a_misconfigured_replica_is_not_restarted_while_the_others_serve(capsys):
    children = [Child("worker-0", "worker", MISCONFIGURED), Child("worker-1", "worker", SLEEP)]
    supervisor = Supervisor(children, FAST, "tessera up")
    threading.Timer(2.0, supervisor.request_stop).start()
    assert supervisor.run() == 0
    out = capsys.readouterr().out
    assert out.count("worker-0 pid") == 1 and "restarting" not in out and "left; stopping" not in out
    assert out.count("giving up on worker-0: it exited with a configuration error") == 1


def test_stop_kills_what_does_not_exit_within_the_grace_period():
    stubborn = subprocess.Popen(python("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                       "print('ready', flush=True)\ntime.sleep(60)"), stdout=subprocess.PIPE, text=True)
    stubborn.stdout.readline()
    t0 = time.monotonic()
    stop([stubborn], timeout_s=0.5)
    assert stubborn.returncode == -9 and time.monotonic() - t0 < 5


@pytest.mark.e2e
def test_up_reports_a_worker_port_in_use_once_and_exits_1(tmp_path):
    """The worker's start-up fails on its port (bound exclusively): one message naming the
    port, no restart, and `tessera up` ends with 1 since no worker is left."""
    holder = socket.socket()
    # SO_REUSEPORT as a default gRPC server's socket has it: a worker that did not bind
    # exclusively would share the port with it without a word
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    topology = tmp_path / "taken.yaml"
    topology.write_text(yaml.safe_dump({
        "name": "taken", "model": "random:llama", "dtype": "float32",
        "roles": {"worker": {"replicas": 1, "port": taken, "threads": 1}, "gateway": {"replicas": 1, "port": 1}}}))
    up = Logged("up", str(topology), "--port", str(free_port()), "--restart-backoff-s", "0.1",
                env={k: v for k, v in os.environ.items() if k != "REDIS_URL"})
    try:
        assert up.proc.wait(timeout=120) == 1
        up.wait_for("no worker left; stopping", 5)
        text = "\n".join(up.lines)
        assert len([line for line in up.lines if "error:" in line and f":{taken}" in line]) == 1, text
        assert "Traceback" not in text and "usage:" not in text, text
        assert "restarting" not in text and "(restart 1)" not in text, text
        assert "giving up on worker-0: it exited with a configuration error" in text, text
    finally:
        up.close()
        holder.close()
