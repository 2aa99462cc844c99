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

# The flags the kernels and oneDNN choose their paths by (/proc/cpuinfo spelling).
FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
         "amx_tile", "amx_bf16", "amx_int8")
# Intel family 6 models that have AMX: Sapphire Rapids, Emerald Rapids, Granite Rapids (a guest
# whose hypervisor hides the amx flags is "xeon-amx-hidden": bf16 runs on AVX512-BF16 there).
AMX_MODELS = {143, 207, 173, 174}
KINDS = ("zen3", "zen4", "zen5", "xeon-amx", "xeon-amx-hidden", "xeon-avx512", "other")
CPU_NAMES = {"zen3": "AMD EPYC Zen 3", "zen4": "AMD EPYC Zen 4", "zen5": "AMD EPYC Zen 5",
             "xeon-amx": "Intel Xeon with AMX", "xeon-amx-hidden": "Intel Xeon with AMX hidden",
             "xeon-avx512": "Intel Xeon with AVX-512"}


def cpu_kind(vendor: str, family: int | None, model: int | None, flags: set[str]) -> str:
    """The kind of CPU, from its vendor, family, model and flags ("other" when none fits)."""
    if vendor == "AuthenticAMD" and family == 25 and model is not None:
        return "zen4" if 0x10 <= model <= 0x1F or 0x60 <= model <= 0x7F or 0xA0 <= model <= 0xAF else "zen3"
    if vendor == "AuthenticAMD" and family == 26:
        return "zen5"
    if vendor == "GenuineIntel":
        if "amx_tile" in flags:
            return "xeon-amx"
        if family == 6 and model in AMX_MODELS:
            return "xeon-amx-hidden"
        if "avx512f" in flags:
            return "xeon-avx512"
    return "other"


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} off Linux)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


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
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    family, model = _int(info.get("cpu family")), _int(info.get("model"))
    kind = cpu_kind(info.get("vendor_id", ""), family, model, flags)
    return {"cpu": CPU_NAMES.get(kind, info.get("model name") or platform.processor() or platform.machine()),
            "kind": kind, "model_name": info.get("model name"), "family": family, "model": model,
            "flags": [f for f in FLAGS if f in flags], "cores": os.cpu_count(),
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
