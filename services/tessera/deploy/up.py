"""`tessera up FILE`: run every process of a topology on this machine under a Supervisor
(deploy/supervisor.py): a process that dies is restarted with backoff while the others keep
serving; SIGTERM / Ctrl-C drains. A `redis` role uses the Redis at $REDIS_URL when set, else a
redis-server started here on a free port (no persistence), restarted on that same port.

Trust: every internal link is mutual TLS. Unless --certs names a directory `tessera certs`
wrote, a throwaway CA and one certificate per role are made at start in a private directory
(0700, removed at exit) and each process finds its own through $TESSERA_TLS_DIR. The local
Redis gets a generated password, in a config file in that directory; every process gets it
as $REDIS_PASSWORD. Nothing secret is on a command line or in the output."""
from __future__ import annotations

import contextlib
import os
import pathlib
import secrets
import shutil
import socket
import tempfile
from dataclasses import replace

from tessera import redis_conn
from tessera.config import ConfigError
from tessera.deploy.supervisor import Child, Supervisor, SupervisorConfig, stop, tessera_argv
from tessera.deploy.topology import LOCAL, Topology
from tessera.mtls import ENV as TLS_ENV
from tessera.mtls.certs import write_role_dirs
from tessera.mtls.names import role_name

__all__ = ["stop", "tessera_argv", "up"]
DRAINING_ROLES = ("worker", "draft_worker", "target_worker", "attention_node", "expert_node",
                  "pipeline_shard", "gateway")   # they take --shutdown-grace-s
HELPER_ROLES = ("draft_worker",)   # not essential: its target decodes plainly while it is down


def up(topology: Topology, config: SupervisorConfig = SupervisorConfig(), certs: str | None = None) -> int:
    from tessera.models.loader import resolve_model_path
    resolve_model_path(topology.model)   # fail early; a random:ARCH model is created once, here
    children, place, env = [], LOCAL, {}
    with tempfile.TemporaryDirectory(prefix="tessera-up-") as scratch:
        tls = role_dirs(topology, scratch, certs)
        if topology.registry:
            url, password = redis_conn.split_password(os.environ.get("REDIS_URL", ""))
            if not url:
                password = secrets.token_urlsafe(24)
                redis, url = _redis_child(scratch, password)
                children.append(redis)
            if password:
                env[redis_conn.PASSWORD_ENV] = password
            print(f"tessera up: registry {url}", flush=True)
            place = replace(LOCAL, redis_url=url)
        grace = ["--shutdown-grace-s", f"{config.shutdown_grace_s:g}"]
        for p in topology.processes(place):
            if p.role == "redis":
                continue
            print(f"tessera up: {p.name} on port {p.port}: tessera {' '.join(p.argv)}", flush=True)
            argv = [*p.argv, *grace] if p.role in DRAINING_ROLES else list(p.argv)
            children.append(Child(p.name, p.role, tessera_argv(argv), essential=p.role not in HELPER_ROLES,
                                  env={**env, TLS_ENV: str(tls[role_name(p.role)])}))
        return Supervisor(children, config, "tessera up").run()


def role_dirs(topology: Topology, scratch: str, certs: str | None) -> dict[str, pathlib.Path]:
    """Role -> its certificate directory: under `certs` (from `tessera certs`), else a new
    throwaway set in scratch."""
    roles = [role_name(r) for r in topology.roles if r != "redis"]
    if certs is None:
        return write_role_dirs(pathlib.Path(scratch) / "tls", deployment_name(topology), roles)
    dirs = {r: pathlib.Path(certs) / r for r in roles}
    missing = [str(d) for d in dirs.values() if not (d / "tls.crt").is_file()]
    if missing:
        raise ConfigError(f"--certs {certs}: no certificate for {', '.join(missing)} (tessera certs FILE --out DIR)")
    return dirs


def deployment_name(topology: Topology) -> str:
    """The topology's name as certificates carry it (a DNS label)."""
    name = "".join(c if c in "abcdefghijklmnopqrstuvwxyz0123456789" else "-" for c in topology.name.lower())
    return name[:63].strip("-") or "tessera"


def _redis_child(scratch: str, password: str) -> tuple[Child, str]:
    """A redis-server on a port chosen now, so that a restart comes back on the same port; its
    password in a config file only this user reads."""
    server = shutil.which("redis-server")
    if server is None:
        raise ConfigError("the topology has a redis role: set REDIS_URL or install redis-server")
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = pathlib.Path(scratch) / "redis.conf"
    fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"requirepass {password}\n")
    argv = [server, str(conf), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", scratch, "--loglevel", "warning"]
    # Not essential: without Redis the gateway keeps its last-known workers.
    return Child("redis-0", "redis", argv, essential=False), f"redis://127.0.0.1:{port}/0"
