"""The kind of CPU this is, as the kernels choose their code paths by it (zen1, zen2, zen3, zen4, zen5,
xeon-amx, ...): result files (bench/machine.py) and measured profiles (machine_profiles.py)
record it."""
from __future__ import annotations

import pathlib
import platform

# The flags the kernels and oneDNN choose their paths by (/proc/cpuinfo spelling).
FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
         "amx_tile", "amx_bf16", "amx_int8")
# Intel family 6 models that have AMX: Sapphire Rapids, Emerald Rapids, Granite Rapids (a guest
# whose hypervisor hides the amx flags is "xeon-amx-hidden": bf16 runs on AVX512-BF16 there).
AMX_MODELS = {143, 207, 173, 174}
KINDS = ("zen1", "zen2", "zen3", "zen4", "zen5", "xeon-amx", "xeon-amx-hidden", "xeon-avx512", "other")
CPU_NAMES = {"zen1": "AMD EPYC Zen 1", "zen2": "AMD EPYC Zen 2", "zen3": "AMD EPYC Zen 3", "zen4": "AMD EPYC Zen 4", "zen5": "AMD EPYC Zen 5",
             "xeon-amx": "Intel Xeon with AMX", "xeon-amx-hidden": "Intel Xeon with AMX hidden",
             "xeon-avx512": "Intel Xeon with AVX-512"}


def cpu_kind(vendor: str, family: int | None, model: int | None, flags: set[str]) -> str:
    """The kind of CPU, from its vendor, family, model and flags ("other" when none fits)."""
    if vendor == "AuthenticAMD" and family == 23 and model is not None:   # AVX2 only
        return "zen2" if model >= 0x30 else "zen1"
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


def describe_cpu() -> dict:
    """This CPU: our name for its kind (else lscpu's), the kind, lscpu's model name, family,
    model and the flags of FLAGS it has."""
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    family, model = _int(info.get("cpu family")), _int(info.get("model"))
    kind = cpu_kind(info.get("vendor_id", ""), family, model, flags)
    return {"cpu": CPU_NAMES.get(kind, info.get("model name") or platform.processor() or platform.machine()),
            "kind": kind, "model_name": info.get("model name"), "family": family, "model": model,
            "flags": [f for f in FLAGS if f in flags]}
