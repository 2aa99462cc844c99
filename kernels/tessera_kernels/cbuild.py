"""Build a C kernel from csrc/ on first use and load it with ctypes.

The source is compiled with the host's C compiler (-O3 -march=native -fopenmp) into a cache
directory keyed by the source, the shared headers (csrc/*.h), the compiler, the flags and the
CPU, so a machine with other vector units (AVX2 only, AVX-512, AMX) builds its own. A target
without AVX-512 builds the same source as C++ where it can (see _cxx). ctypes releases the GIL
during a call. Where no compiler is found or the build fails, load() returns None and callers
use their torch path; TESSERA_DISABLE_CPU_KERNELS=1 does the same on purpose (for A/B
measurements). TESSERA_MARCH (default native) picks the target CPU.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import threading

from tessera_kernels import replay

_CSRC = pathlib.Path(__file__).parent / "csrc"
# TESSERA_MARCH builds for another CPU than this one (e.g. "haswell": AVX2 only), so the AVX2
# paths are tested on an AVX-512 machine too; the cache key includes it.
_FLAGS = ["-O3", f"-march={os.environ.get('TESSERA_MARCH', 'native')}", "-ffp-contract=fast", "-fopenmp",
          "-shared", "-fPIC"]
_lock = threading.Lock()
_libs: dict[tuple[str, tuple[str, ...]], ctypes.CDLL | None] = {}


def load(name: str, flags: tuple[str, ...] = (), kernel: bool = True) -> ctypes.CDLL | None:
    """csrc/<name>.c compiled (with `flags` after the usual ones, e.g. "-mno-avx512bf16") and
    loaded once per process; None when it cannot be built. kernel=False: a helper that is no
    kernel (bind_threads), loaded even when TESSERA_DISABLE_CPU_KERNELS turns the kernels off."""
    if kernel and os.environ.get("TESSERA_DISABLE_CPU_KERNELS") == "1":
        return None
    with _lock:
        if (name, flags) not in _libs:
            _libs[name, flags] = _build(name, list(flags))
        return _libs[name, flags]


def _build(name: str, flags: list[str]) -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None
    cxx = _cxx(cc)
    if cxx is not None:
        lib = _compile(name, cxx, ["-x", "c++", "-std=gnu++17", "-I", str(_CSRC)], _CXX_WRAPPER.format(name=name),
                       flags)
        if lib is not None:
            return lib
    return _compile(name, cc, [], None, flags)


def _compile(name: str, compiler: str, lang: list[str], stdin: str | None, flags: list[str]) -> ctypes.CDLL | None:
    """csrc/<name>.c built with `compiler` (C, or C++ from `stdin`) into the cache and loaded;
    flags go after the usual ones, so they override -march's."""
    src = _CSRC / f"{name}.c"
    headers = b"".join(h.read_bytes() for h in sorted(_CSRC.glob("*.h")))
    key = hashlib.sha256(src.read_bytes() + headers + " ".join([compiler, *lang, *_FLAGS, *flags, stdin or ""]).encode()
                         + _cpu_id()).hexdigest()[:16]
    cache = pathlib.Path(os.environ.get("TESSERA_CACHE", pathlib.Path.home() / ".cache" / "tessera"))
    so = cache / "kernels" / f"{name}-{key}.so"
    try:
        if not so.exists():
            so.parent.mkdir(parents=True, exist_ok=True)
            tmp = so.with_suffix(f".{os.getpid()}.tmp")
            source = "-" if stdin is not None else str(src)
            subprocess.run([compiler, *lang, *_FLAGS, *flags, source, "-o", str(tmp), "-lm"], check=True,
                           input=stdin.encode() if stdin is not None else None, capture_output=True, timeout=120)
            os.replace(tmp, so)
        return replay.RecordableCDLL(str(so))
    except (OSError, subprocess.SubprocessError):
        return None


# A C++ build's source: the headers first (C++ ones may not sit inside extern "C"), then the
# kernel with C linkage, so that ctypes finds its functions by their C names.
_CXX_WRAPPER = """#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include "vec16.h"
extern "C" {{
#include "{name}.c"
}}
"""


@functools.cache
def _cxx(cc: str) -> str | None:
    """The C++ compiler for a target without AVX-512, where one is found: the same source built
    as C++ gives vec16.h's 16 lanes as two AVX2 registers (vec16_avx2.h says why: GCC's 64-byte
    vectors go through memory there). None: build as C (correct everywhere, slower there)."""
    if _target_has_avx512(cc):
        return None
    return shutil.which(os.environ.get("CXX") or "g++") or shutil.which("c++")


@functools.cache
def _target_has_avx512(cc: str) -> bool:
    """Whether the compiler, given _FLAGS' -march, targets AVX-512 (__AVX512F__ defined)."""
    try:
        macros = subprocess.run([cc, *_FLAGS[:2], "-dM", "-E", "-x", "c", os.devnull], check=True,
                                capture_output=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return True   # unknown: the plain C build, which is correct everywhere
    return b"__AVX512F__" in macros


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags ("avx512_bf16", "amx_bf16", ...) from /proc/cpuinfo; empty where
    there is none."""
    for line in _cpu_id().decode(errors="replace").splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@functools.cache
def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD"); empty where there is none."""
    for line in _cpu_id().decode(errors="replace").splitlines():
        if line.startswith("vendor_id"):
            return line.split(":", 1)[1].strip()
    return ""


def _cpu_id() -> bytes:
    try:
        return pathlib.Path("/proc/cpuinfo").read_bytes().split(b"\n\n")[0]
    except OSError:
        return b""
