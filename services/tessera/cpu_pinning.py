"""The worker's OpenMP threads pinned, one per core of the CPUs it may use (as vLLM-CPU binds
its threads by default): tessera_kernels/csrc/bind_threads.c says what unpinned threads cost
next to another busy process.

Pinned only when the worker holds every core it may use: no --threads and as many torch
threads as cores (replicas given --threads or OMP_NUM_THREADS share cores, and pinned they
would pile onto the same first CPUs, as the vLLM worker's rule has it too; more threads than
cores are hyperthreads, which the OS places better), no OpenMP binding of the user's own
(OMP_PROC_BIND, OMP_PLACES, GOMP_CPU_AFFINITY, KMP_AFFINITY), and not with --no-pin-threads.
What the pinned engine thread starts later (a lazily built kernel's compiler) runs on its CPU.
"""
from __future__ import annotations

import logging
import os
import pathlib

import torch

from tessera.config import EngineConfig

log = logging.getLogger("tessera.worker")
_USER_BINDING = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")


def pin_engine_threads(config: EngineConfig) -> list[int] | None:
    """From the thread that runs the engine's parallel regions: its team pinned, thread i to
    the i-th core; the CPUs used, or None when left to the OS."""
    if (not config.pin_threads or config.num_threads or any(os.environ.get(v) for v in _USER_BINDING)
            or not hasattr(os, "sched_getaffinity")):
        return None
    cores = one_cpu_per_core(sorted(os.sched_getaffinity(0)))
    if torch.get_num_threads() != len(cores):
        return None
    from tessera_kernels.bind_threads import bind_team
    if not bind_team(cores):
        log.warning("could not pin the engine's %d threads to CPUs %s; they stay unpinned", len(cores), cores)
        return None
    log.info("engine threads pinned to CPUs %s", ",".join(map(str, cores)))
    return cores


def one_cpu_per_core(cpus: list[int], sysfs: pathlib.Path = pathlib.Path("/sys/devices/system/cpu")) -> list[int]:
    """The first of `cpus` on each physical core (two hyperthreads of one core share its
    vector units: one thread each would halve both); all of them where the topology is unknown."""
    seen, out = set(), []
    for cpu in cpus:
        try:
            topology = sysfs / f"cpu{cpu}" / "topology"
            core = ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip())
        except OSError:
            return cpus
        if core not in seen:
            seen.add(core)
            out.append(cpu)
    return out
