"""The topology file: which roles run, how many replicas, on which ports, with which model,
dtype and transport. `tessera up` turns it into processes here; compose and Kubernetes files
are meant to be generated from the same `processes()` list.

    name: disagg-dense
    model: smollm2            # or random:ARCH, or a path
    dtype: auto
    transport: auto           # M2N backend for AFD roles
    roles:
      expert_node:    {replicas: 2, port: 50071, threads: 1}
      attention_node: {replicas: 1, port: 50061, micro_batches: 2}
      gateway:        {replicas: 1, port: 8000}

Replica i of a role listens on port + i. Roles start in dependency order (ROLE_ORDER).
"""
from __future__ import annotations

import pathlib
from dataclasses import dataclass, field, replace

import yaml

from tessera.config import ConfigError

ROLE_ORDER = ("worker", "expert_node", "attention_node", "gateway")
ROLE_OPTIONS = {"replicas", "port", "threads", "micro_batches", "ffn_timeout_s"}
HOST = "127.0.0.1"


@dataclass(frozen=True)
class Role:
    name: str
    replicas: int
    port: int
    options: dict = field(default_factory=dict)

    def address(self, i: int) -> str:
        return f"{HOST}:{self.port + i}"


@dataclass(frozen=True)
class Process:
    name: str          # e.g. expert-node-1
    role: str
    port: int
    argv: tuple[str, ...]   # arguments of the `tessera` command


@dataclass(frozen=True)
class Topology:
    name: str
    model: str
    dtype: str
    transport: str
    roles: dict

    @classmethod
    def load(cls, path: str | pathlib.Path) -> "Topology":
        data = yaml.safe_load(pathlib.Path(path).read_text())
        if not isinstance(data, dict) or not isinstance(data.get("roles"), dict):
            raise ConfigError(f"{path}: a topology needs a 'roles' mapping")
        roles = {}
        for name, spec in data["roles"].items():
            if name not in ROLE_ORDER:
                raise ConfigError(f"{path}: unknown role {name!r} (known: {', '.join(ROLE_ORDER)})")
            spec = dict(spec or {})
            unknown = set(spec) - ROLE_OPTIONS
            if unknown:
                raise ConfigError(f"{path}: role {name} has unknown options {sorted(unknown)}")
            replicas, port = int(spec.pop("replicas", 1)), spec.pop("port", None)
            if replicas < 1 or port is None:
                raise ConfigError(f"{path}: role {name} needs replicas >= 1 and a port")
            roles[name] = Role(name, replicas, int(port), spec)
        if "gateway" not in roles or not ({"worker", "attention_node"} & set(roles)):
            raise ConfigError(f"{path}: a topology needs a gateway and workers or attention nodes")
        if ("attention_node" in roles) != ("expert_node" in roles):
            raise ConfigError(f"{path}: attention nodes and expert nodes come together")
        return cls(data.get("name", pathlib.Path(path).stem), str(data.get("model", "smollm2")),
                   str(data.get("dtype", "auto")), str(data.get("transport", "auto")), roles)

    def with_overrides(self, port: int | None = None, dtype: str | None = None) -> "Topology":
        roles = dict(self.roles)
        if port is not None:
            roles["gateway"] = replace(roles["gateway"], port=port)
        return replace(self, roles=roles, dtype=dtype or self.dtype)

    def processes(self) -> list[Process]:
        out = []
        for role_name in ROLE_ORDER:
            role = self.roles.get(role_name)
            for i in range(role.replicas if role else 0):
                out.append(Process(f"{role_name.replace('_', '-')}-{i}", role_name, role.port + i,
                                   tuple(self._argv(role, i))))
        return out

    def _argv(self, role: Role, i: int) -> list[str]:
        model = ["--model", self.model, "--dtype", self.dtype]
        common = ["--host", HOST, "--port", str(role.port + i)]
        threads = ["--threads", str(role.options["threads"])] if "threads" in role.options else []
        if role.name == "worker":
            return ["worker", *model, *common, *threads]
        if role.name == "expert_node":
            n = role.replicas
            return ["expert-node", *model, *common, *threads, "--name", f"expert-{i}", "--shard-index", str(i),
                    "--shard-count", str(n), "--transport", self.transport]
        if role.name == "attention_node":
            experts = self.roles["expert_node"]
            argv = ["attention-node", *model, *common, *threads, "--name", f"attention-{i}",
                    "--transport", self.transport,
                    "--micro-batches", str(role.options.get("micro_batches", 2))]
            if "ffn_timeout_s" in role.options:
                argv += ["--ffn-timeout-s", str(role.options["ffn_timeout_s"])]
            return argv + [a for j in range(experts.replicas) for a in ("--expert", experts.address(j))]
        backends = self.roles.get("attention_node") or self.roles["worker"]
        argv = ["gateway", "--host", HOST, "--port", str(role.port + i)]
        return argv + [a for j in range(backends.replicas) for a in ("--worker", backends.address(j))]
