"""Measured profiles (LLM-PQ layer times, AFD step times) hold only on the kind of CPU they were
taken on (the kernels choose their code paths by it). Each profile records its
machine (`recorded_machine`), and a planner reads it through `for_this_machine`: the profile
itself when this machine is of the same kind, else its re-profiled copy FILE.KIND.json beside
it, else a refusal that names the command making that copy."""
from __future__ import annotations

import json
import pathlib

from tessera.cpu_kind import describe_cpu
from tessera.config import ConfigError


def recorded_machine() -> dict:
    """The `machine` entry of a profile: the kind the kernels choose their paths by, and its name."""
    m = describe_cpu()
    return {k: m[k] for k in ("kind", "cpu", "model_name", "flags")}


def local_copy(path: pathlib.Path, kind: str) -> pathlib.Path:
    return path.with_name(f"{path.stem}.{kind}.json")


def for_this_machine(path: str | pathlib.Path, remake: str) -> tuple[pathlib.Path, dict]:
    """(the file used, its data). remake: the command that profiles here, without --out."""
    path = pathlib.Path(path)
    data = json.loads(path.read_text())
    here = recorded_machine()["kind"]
    taken = (data.get("machine") or {}).get("kind")
    if taken == here:
        return path, data
    copy = local_copy(path, here)
    if copy.exists():
        local = json.loads(copy.read_text())
        if (local.get("machine") or {}).get("kind") == here:
            return copy, local
    raise ConfigError(f"{path} was profiled on {taken or 'a machine it does not record'}, and this machine is "
                      f"{here}: its times do not hold here. Profile this machine with `{remake} --out {copy}`; "
                      "planners then use that copy")
