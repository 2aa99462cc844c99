"""Exit codes that tell a supervisor (deploy/supervisor.py, compose, systemd) what to do next.

A process that cannot start because of how it was configured (unknown architecture, port in
use, bad certificate, bad flag) would fail the same way on every restart: it ends once with one
message and CONFIG_ERROR, and `tessera up` / `tessera serve` give up on it at once instead of
restarting it. Any other exit is restarted with backoff."""
from __future__ import annotations

import sys

CONFIG_ERROR = 78   # EX_CONFIG in sysexits.h; systemd's RestartPreventExitStatus= names codes like it


def config_error(command: str, message: str) -> int:
    """Print the one line a configuration error gets and return the exit code to end with."""
    print(f"tessera {command}: error: {message}", file=sys.stderr, flush=True)
    return CONFIG_ERROR
