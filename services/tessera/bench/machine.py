"""What machine a benchmark ran on, for the `machine` and `versions` fields of a result file
(bench/results/, rendered by bench/render.py): the CPU as lscpu names it, the kind of CPU the
kernels choose their code paths by, the ISA flags that decide those paths, cores, memory and a
short measured memory bandwidth, and the versions of Python, torch, Tessera and vLLM.
"""
from __future__ import annotations

import datetime
import os
import pathlib
import platform
import subprocess
import sys
import time

from tessera.cpu_kind import FLAGS, cpu_kind, describe_cpu  # noqa: F401  (re-exported for tests and scripts)


def memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def mem_bandwidth_gbs(mib: int = 256, repeats: int = 3) -> float | None:
    """GB/s of a copy of `mib` MiB (bytes read + bytes written per second), best of `repeats`:
    well under a second. None without torch."""
    try:
        import torch
    except ImportError:
        return None
    src = torch.ones(mib << 18, dtype=torch.float32)     # mib MiB
    dst = torch.empty_like(src)
    dst.copy_(src)                                        # pages touched before timing
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return round(2 * src.numel() * 4 / best / 1e9, 1)


def _git_commit() -> str | None:
    root = pathlib.Path(__file__).resolve().parents[3]
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def versions() -> dict:
    def version(module: str) -> str | None:
        try:
            return __import__(module).__version__
        except Exception:            # not installed, or fails to import here: not recorded
            return None
    tessera = _git_commit()
    if tessera is None:
        try:
            from importlib.metadata import version as dist_version
            tessera = dist_version("tessera")
        except Exception:
            tessera = None
    return {"tessera": tessera, "torch": version("torch"), "python": platform.python_version(),
            "vllm": version("vllm")}


def machine(bandwidth: bool = True) -> dict:
    """The `machine` field of a result file."""
    return {**describe_cpu(), "cores": os.cpu_count(),
            "memory_gib": memory_gib(), "mem_bandwidth_gbs": mem_bandwidth_gbs() if bandwidth else None}


def command_line(argv: list[str] | None = None) -> str:
    """This process's command line as a user would type it: `tessera ...` for the CLI (however
    it was started), `python SCRIPT ...` for a script."""
    argv = list(sys.argv if argv is None else argv)
    name = pathlib.Path(argv[0]).name if argv else ""
    if name in ("tessera", "cli.py", "__main__.py"):
        head = ["tessera"]
    elif name.endswith(".py"):
        head = ["python", os.path.relpath(argv[0]) if os.path.isabs(argv[0]) else argv[0]]
    else:
        head = argv[:1]
    return " ".join(head + argv[1:])


def describe(bandwidth: bool = True) -> dict:
    """machine, versions, date (UTC, ISO) and command (this process's argv) of a result file."""
    return {"machine": machine(bandwidth), "versions": versions(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": command_line()}


if __name__ == "__main__":
    import json
    print(json.dumps(describe(), indent=1))
