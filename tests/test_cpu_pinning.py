"""The worker's OpenMP threads pinned one per core (cpu_pinning.py) when it holds every core
it may use, and left to the OS with --threads (replicas sharing cores)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from servers import tessera_worker
from tessera.cpu_pinning import one_cpu_per_core


def _threads_on_one_cpu(pid: int) -> tuple[list[int], set[int]]:
    """The CPUs of the worker's threads that may run on one CPU only (of several the machine
    gives), and its main thread's CPUs."""
    pinned, main = [], set()
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            allowed = os.sched_getaffinity(int(task.name))
        except ProcessLookupError:     # a thread that ended while we looked
            continue
        if int(task.name) == pid:
            main = allowed
        elif len(allowed) == 1 < len(os.sched_getaffinity(0)):
            pinned.append(next(iter(allowed)))
    return sorted(pinned), main


@pytest.mark.e2e
def test_a_worker_pins_one_thread_per_core_unless_given_threads():
    allowed = sorted(os.sched_getaffinity(0))
    cores = one_cpu_per_core(allowed)
    threads = int(subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                                 capture_output=True, text=True, check=True).stdout)   # a fresh process's default
    expected = cores if threads == len(cores) and len(allowed) > 1 else []
    with tessera_worker("--graph-warmup-s", "0") as (_, proc):
        pinned, main = _threads_on_one_cpu(proc.pid)
    assert pinned == expected and main == set(allowed), (pinned, expected, main)
    with tessera_worker("--graph-warmup-s", "0", "--threads", str(threads)) as (_, proc):
        assert _threads_on_one_cpu(proc.pid) == ([], set(allowed))


def test_one_cpu_per_core_skips_hyperthread_siblings(tmp_path):
    for cpu, core in enumerate([0, 1, 0, 1]):          # 2 cores x 2 hyperthreads, siblings 0+2, 1+3
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{core}\n")
    assert one_cpu_per_core([0, 1, 2, 3], tmp_path) == [0, 1]
    assert one_cpu_per_core([2, 3], tmp_path) == [2, 3]
    assert one_cpu_per_core([0, 7], tmp_path) == [0, 7]     # cpu7's topology unknown: all of them
