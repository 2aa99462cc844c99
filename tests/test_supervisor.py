"""The restart policy of `tessera up` / `tessera serve`, on tiny fake processes: restarts with
exponential backoff, giving up on a process that keeps dying (exit 1 only when no replica of a
serving role is left), draining last-started role first, and SIGKILL after the grace period."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

from tessera.deploy.supervisor import Child, Supervisor, SupervisorConfig, stop

FAST = SupervisorConfig(max_restarts=2, restart_window_s=30, restart_backoff_s=0.05, max_restart_backoff_s=0.1,
                        shutdown_grace_s=2)


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


CRASH = python("import sys; sys.exit(3)")
SLEEP = python("import time; time.sleep(60)")


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


def test_stop_kills_what_does_not_exit_within_the_grace_period():
    stubborn = subprocess.Popen(python("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                       "print('ready', flush=True)\ntime.sleep(60)"), stdout=subprocess.PIPE, text=True)
    stubborn.stdout.readline()
    t0 = time.monotonic()
    stop([stubborn], timeout_s=0.5)
    assert stubborn.returncode == -9 and time.monotonic() - t0 < 5
