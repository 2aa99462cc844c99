"""The device inventory the LLM-PQ planner partitions a model over (`devices.yaml`).

A file is a list of devices, or a mapping {devices: [...], links: [...], default_link: {...}}.
A device is {name, type, memory_gib?, count?, threads?, slowdown?} plus where its latency comes
from: `profile: FILE` (a `tessera profile pq` JSON, measured) or a GPU type of gpu_specs.yaml
(`gpu: A100-40G`, or a `type` that names one: roofline, simulated). Devices sharing a type share
a latency model; the planner enumerates orders of types. A link is {between: [A, B], latency_us,
bandwidth_gbs} or {between: [A, B], points: [[bytes, seconds], ...]} (fitted), A and B naming
devices or types; without one, transfers are free (and the CLI says so).

    - {name: big, type: cpu-2t, memory_gib: 0.25, threads: 2, profile: pq-profile-2t.json}
    - {name: small, type: cpu-slow, memory_gib: 0.1, profile: pq-profile-2t.json, slowdown: 2.0}
    - {name: t4, type: T4, count: 3}
"""
from __future__ import annotations

import functools
import pathlib
from dataclasses import dataclass

import yaml

from tessera.pipeline.costmodel import GpuSpec, Link

SPECS_FILE = pathlib.Path(__file__).with_name("gpu_specs.yaml")
# usable = 0.95 x memory - (430 MB CUDA context + 1.5 GB torch temporaries):
# docs/design/pipeline.md#gpu-memory
GPU_USABLE, GPU_RESERVED = 0.95, (430 + 1500) * 2 ** 20


@functools.lru_cache(maxsize=1)
def load_gpu_specs() -> dict[str, GpuSpec]:
    data = yaml.safe_load(SPECS_FILE.read_text())
    return {name: GpuSpec(name, **fields) for name, fields in data.items()}


@dataclass(frozen=True)
class Device:
    """One pipeline stage's device. `slowdown` multiplies its latency model (emulating a slower
    device of the same kind on this machine: docs/design/pipeline.md#virtual-devices);
    memory_gib is its memory (a GPU's usable share is taken by budget_bytes)."""
    name: str
    type: str
    memory_gib: float
    profile: str | None = None
    gpu: str | None = None
    threads: int | None = None
    slowdown: float = 1.0

    def __post_init__(self) -> None:
        if (self.profile is None) == (self.gpu is None):
            raise ValueError(f"device {self.name}: give exactly one of a latency profile or a GPU type")
        if self.gpu is not None and self.gpu not in load_gpu_specs():
            raise ValueError(f"device {self.name}: unknown GPU type {self.gpu!r} (known: {sorted(load_gpu_specs())})")
        if self.memory_gib <= 0 or self.slowdown <= 0:
            raise ValueError(f"device {self.name}: memory_gib and slowdown must be > 0")

    def budget_bytes(self) -> float:
        """Bytes the plan may use: a GPU's usable share (docs/design/pipeline.md#gpu-memory); a
        profiled (CPU) device is a virtual budget, all of it."""
        if self.gpu is not None:
            return GPU_USABLE * self.memory_gib * 2 ** 30 - GPU_RESERVED
        return self.memory_gib * 2 ** 30


@dataclass(frozen=True)
class Cluster:
    devices: tuple[Device, ...]
    links: tuple[tuple[str, str, Link], ...] = ()
    default_link: Link = Link()
    links_given: bool = False

    def __post_init__(self) -> None:
        if not self.devices:
            raise ValueError("no devices")
        names = [d.name for d in self.devices]
        if len(set(names)) != len(names):
            raise ValueError(f"device names must be unique: {names}")

    def link(self, a: Device, b: Device) -> Link:
        """The link between two devices: one named for the pair of names, else for the pair of
        types, else the default."""
        for keys in ({a.name, b.name}, {a.type, b.type}):
            for x, y, link in self.links:
                if {x, y} == keys:
                    return link
        return self.default_link

    def types(self) -> tuple[str, ...]:
        """Device types in the order they first appear."""
        return tuple(dict.fromkeys(d.type for d in self.devices))


def parse_devices(entries: list[dict], base: pathlib.Path) -> tuple[Device, ...]:
    devices = []
    for e in entries:
        e = dict(e)
        count = int(e.pop("count", 1))
        dtype = e.pop("type", None)
        name = str(e.pop("name", None) or dtype)
        if not dtype:
            raise ValueError(f"device {name}: missing type")
        gpu = e.pop("gpu", None) or (dtype if dtype in load_gpu_specs() and "profile" not in e else None)
        memory = e.pop("memory_gib", None)
        if memory is None and gpu is not None:
            memory = load_gpu_specs()[gpu].memory_gib
        if memory is None:
            raise ValueError(f"device {name}: missing memory_gib")
        profile = e.pop("profile", None)
        profile = str(base / profile) if profile is not None else None
        unknown = set(e) - {"threads", "slowdown"}
        if unknown:
            raise ValueError(f"device {name}: unknown fields {sorted(unknown)}")
        for k in range(count):
            devices.append(Device(name if count == 1 else f"{name}-{k}", dtype, float(memory), profile, gpu,
                                  e.get("threads"), float(e.get("slowdown", 1.0))))
    return tuple(devices)


def parse_link(e: dict) -> Link:
    if "points" in e:
        return Link.fit([tuple(p) for p in e["points"]])
    return Link(float(e.get("latency_us", 0.0)) * 1e-6, float(e.get("bandwidth_gbs", float("inf"))))


def load_cluster(path: str | pathlib.Path) -> Cluster:
    path = pathlib.Path(path)
    data = yaml.safe_load(path.read_text())
    if isinstance(data, list):
        data = {"devices": data}
    if not isinstance(data, dict) or not isinstance(data.get("devices"), list):
        raise ValueError(f"{path}: expected a list of devices or a mapping with 'devices'")
    links = tuple((str(e["between"][0]), str(e["between"][1]), parse_link(e)) for e in data.get("links", []))
    default = parse_link(data["default_link"]) if "default_link" in data else Link()
    return Cluster(parse_devices(data["devices"], path.parent), links, default,
                   bool(links) or "default_link" in data)
