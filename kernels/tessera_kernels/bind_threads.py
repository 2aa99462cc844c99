"""Pin the OpenMP team of the calling thread, one thread per CPU (csrc/bind_threads.c says why)."""
from __future__ import annotations

import ctypes

from tessera_kernels import cbuild


def bind_team(cpus: list[int]) -> bool:
    """Thread i of the calling thread's team (of len(cpus) threads; thread 0 is the caller) to
    cpus[i], or none of them: False when it cannot be built or a thread could not be pinned.
    Call it from the thread that runs every parallel region afterwards: a team belongs to the
    thread that starts it. Threads and processes started later by a pinned thread inherit its
    one CPU. Built even where TESSERA_DISABLE_CPU_KERNELS turns the kernels off (it is not one)."""
    lib = cbuild.load("bind_threads", kernel=False)
    if lib is None or not cpus:
        return False
    array = (ctypes.c_int * len(cpus))(*cpus)
    return lib.bind_team(array, len(cpus)) == len(cpus)
