"""Supervisor: keeps the processes of `tessera up` and `tessera serve` running, as compose's
restart policy and Kubernetes do.

A process that exits is logged and started again after an exponential backoff, while the
others keep serving. One that exits more than max_restarts times within restart_window_s is
given up on and reported; so is, at once, one that ends with a configuration error
(exit_codes.CONFIG_ERROR), which a restart would only repeat. The supervisor stops everything
and exits 1 only when no replica of a role that serves requests is left (a helper such as Redis
is not one). SIGTERM / SIGINT drain: roles are stopped last-started first (gateway, then
workers, then Redis), each SIGTERMed and given shutdown_grace_s to finish its in-flight
requests, then SIGKILLed; the exit code is 0.

No child outlives the supervisor, whatever kills it: each child is tied to it before exec (the
kernel's parent-death signal, SIGTERM, begins its drain) and, being a `tessera` process, ends
itself once its drain has overrun its grace period with nobody left to SIGKILL it
(parent_watch.py).
"""
from __future__ import annotations

import collections
import ctypes
import functools
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from tessera import exit_codes
from tessera.deploy import parent_watch

POLL_S = 0.1


@dataclass(frozen=True)
class SupervisorConfig:
    max_restarts: int = field(default=5, metadata={
        "help": "restarts of one process within --restart-window-s before it is given up on"})
    restart_window_s: float = field(default=60.0, metadata={"help": "the window max_restarts counts in"})
    restart_backoff_s: float = field(default=0.5, metadata={
        "help": "delay before the first restart; doubles with each exit in the window"})
    max_restart_backoff_s: float = field(default=10.0, metadata={"help": "longest delay before a restart"})
    shutdown_grace_s: float = field(default=30.0, metadata={
        "help": "on SIGTERM / Ctrl-C: time in-flight requests get to finish before processes are killed"})

    def __post_init__(self) -> None:
        from tessera.config import ConfigError
        if self.max_restarts < 0 or self.restart_window_s <= 0 or self.shutdown_grace_s < 0:
            raise ConfigError("max_restarts and shutdown_grace_s must be >= 0, restart_window_s > 0")
        if not 0 <= self.restart_backoff_s <= self.max_restart_backoff_s:
            raise ConfigError("restart backoffs must satisfy 0 <= restart_backoff_s <= max_restart_backoff_s")

    def backoff(self, exits_in_window: int) -> float:
        return min(self.max_restart_backoff_s, self.restart_backoff_s * 2 ** max(0, exits_in_window - 1))


@dataclass
class Child:
    """One supervised process. essential: its role serves requests (losing every replica of
    it ends the deployment)."""
    name: str
    role: str
    argv: list[str]
    essential: bool = True
    env: dict | None = None     # extra environment (e.g. its certificate directory), not argv: ps shows argv
    proc: subprocess.Popen | None = None
    exits: collections.deque = field(default_factory=collections.deque)
    restarts: int = 0
    restart_at: float | None = None
    given_up: bool = False


def tessera_argv(args) -> list[str]:
    """The command line that runs `tessera ARGS` with this interpreter."""
    return [sys.executable, "-m", "tessera.cli", *args]


# Looked up here, not in the child: between fork and exec a child of a threaded process may
# only do little, and dlopen's lock may have been held by another thread at fork.
_PRCTL = ctypes.CDLL(None).prctl if sys.platform.startswith("linux") else None
PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """In the child, before exec: SIGTERM (a drain) when the supervisor dies, even by SIGKILL.
    The signal is armed only from now on: a supervisor that died since the fork (its pid is no
    longer our parent's) would never send it, so the child ends here instead of starting.
    The kernel sends it when the thread that forked exits: only run()'s thread starts children."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGTERM))
    if os.getppid() != parent:
        os._exit(1)


def _describe(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"


def _child_env(child: Child, grace_s: float) -> dict:
    """Its extra environment, and who its supervisor is (parent_watch.py)."""
    return {**os.environ, **(child.env or {}), parent_watch.ENV: parent_watch.env_value(grace_s)}


class Supervisor:
    def __init__(self, children: list[Child], config: SupervisorConfig = SupervisorConfig(),
                 label: str = "tessera up") -> None:
        self.children, self.config, self.label = children, config, label
        self._stop_requested = False

    def log(self, message: str) -> None:
        print(f"{self.label}: {message}", flush=True)

    def _spawn(self, child: Child) -> None:
        # Own session: a Ctrl-C in the terminal reaches only the supervisor, which drains in order.
        env = _child_env(child, self.config.shutdown_grace_s)
        child.proc = subprocess.Popen(child.argv, start_new_session=True, env=env,
                                      preexec_fn=functools.partial(_die_with_parent, os.getpid()))
        again = f" (restart {child.restarts})" if child.restarts else ""
        self.log(f"{child.name} pid {child.proc.pid}{again}")

    def start(self) -> None:
        for child in self.children:
            self._spawn(child)

    def step(self, now: float) -> int | None:
        """Notice exits, restart what is due; an exit code when the deployment cannot go on."""
        for child in self.children:
            if child.given_up:
                continue
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.restart_at, child.restarts = None, child.restarts + 1
                    self._spawn(child)
                continue
            if child.proc is not None and child.proc.poll() is not None:
                self._exited(child, now)
        for role in dict.fromkeys(c.role for c in self.children if c.essential):
            if all(c.given_up for c in self.children if c.role == role):
                self.log(f"no {role} left; stopping")
                return 1
        return None

    def _exited(self, child: Child, now: float) -> None:
        code, window = child.proc.returncode, self.config.restart_window_s
        if code == exit_codes.CONFIG_ERROR:
            child.given_up = True
            self.log(f"giving up on {child.name}: it exited with a configuration error (code {code}, its "
                     f"message is above); a restart would fail the same way")
            return
        child.exits.append(now)
        while child.exits and child.exits[0] < now - window:
            child.exits.popleft()
        if len(child.exits) > self.config.max_restarts:
            child.given_up = True
            self.log(f"giving up on {child.name}: it exited {len(child.exits)} times within {window:g} s "
                     f"(last: {_describe(code)})")
            return
        delay = self.config.backoff(len(child.exits))
        child.restart_at = now + delay
        self.log(f"{child.name} (pid {child.proc.pid}) exited with {_describe(code)}; "
                 f"restarting in {delay:.1f} s")

    def request_stop(self, *_) -> None:
        self._stop_requested = True

    def run(self) -> int:
        """Start every child and supervise until a drain is requested (0) or a role is gone (1)."""
        previous = {s: signal.signal(s, self.request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
        code = 0
        try:
            self.start()
            while not self._stop_requested:
                code = self.step(time.monotonic())
                if code is not None:
                    break
                time.sleep(POLL_S)
            if self._stop_requested:
                self.log(f"draining (up to {self.config.shutdown_grace_s:g} s per role)")
        finally:
            self.stop()
            for s, handler in previous.items():
                signal.signal(s, handler)
        return code or 0

    def stop(self) -> None:
        """Last-started role first: SIGTERM its processes, wait for their drain, then SIGKILL."""
        for role in reversed(dict.fromkeys(c.role for c in self.children)):
            procs = [c.proc for c in self.children if c.role == role and c.proc is not None]
            stop(procs, self.config.shutdown_grace_s + 5.0)


def stop(procs: list[subprocess.Popen], timeout_s: float = 10.0) -> None:
    """SIGTERM every process, then SIGKILL whatever has not exited within timeout_s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
