"""A supervised process's own guard against outliving its supervisor (deploy/supervisor.py).

When the supervisor dies, even by SIGKILL, the kernel's parent-death signal (armed before exec)
sends its children SIGTERM, which begins their drain. But the supervisor was also what SIGKILLed
a process whose drain overran its grace period; once it is gone nothing would. watch_from_env(),
called first thing by `tessera` (cli.main), runs a thread that notices the supervisor is gone and
ends the process, with its process group, when the drain has had its grace period."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

# Not a setting but wiring, like an address: who this process's supervisor is ("PID:GRACE_S").
# The environment, not a flag, so that it survives a re-exec (vllm_worker.py) and needs no
# flag in every subcommand.
ENV = "TESSERA_SUPERVISOR"
POLL_S = 0.5
MARGIN_S = 5.0   # past the grace period, as the supervisor's own stop() allows


def env_value(grace_s: float) -> str:
    """The value this process, a supervisor, gives its children."""
    return f"{os.getpid()}:{grace_s:g}"


def watch_from_env() -> bool:
    """Start the watch when this process is a child of the supervisor that $TESSERA_SUPERVISOR
    names; True when started. A process whose parent is another one (a grandchild that inherited
    the variable) is left alone: its own parent answers for it."""
    try:
        pid, grace = os.environ[ENV].split(":")
        parent, deadline_s = int(pid), float(grace) + MARGIN_S
    except (KeyError, ValueError):
        return False
    if os.getppid() != parent:
        return False
    threading.Thread(target=_watch, args=(parent, deadline_s), name="parent-watch", daemon=True).start()
    return True


def _watch(parent: int, deadline_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    time.sleep(deadline_s)   # the parent-death signal began the drain when the parent died
    print(f"tessera: the supervisor (pid {parent}) is gone and the drain did not end within "
          f"{deadline_s:g} s; exiting", file=sys.stderr, flush=True)
    if os.getpgrp() == os.getpid():   # a session leader, as the supervisor starts it: its own children too
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(1)
