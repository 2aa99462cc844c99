"""`tessera up FILE`: run every process of a topology on this machine under a Supervisor
(deploy/supervisor.py): a process that dies is restarted with backoff while the others keep
serving; SIGTERM / Ctrl-C drains. A `redis` role uses the Redis at $REDIS_URL when set, else a
redis-server started here on a free port (no persistence), restarted on that same port."""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import tempfile
from dataclasses import replace

from tessera import cluster_auth
from tessera.config import ConfigError
from tessera.deploy.supervisor import Child, Supervisor, SupervisorConfig, stop, tessera_argv
from tessera.deploy.topology import LOCAL, Topology

__all__ = ["stop", "tessera_argv", "up"]
DRAINING_ROLES = ("worker", "draft_worker", "target_worker", "attention_node", "expert_node",
                  "pipeline_shard", "gateway")   # they take --shutdown-grace-s
HELPER_ROLES = ("draft_worker",)   # not essential: its target decodes plainly while it is down


def up(topology: Topology, config: SupervisorConfig = SupervisorConfig()) -> int:
    from tessera.models.loader import resolve_model_path
    resolve_model_path(topology.model)   # fail early; a random:ARCH model is created once, here
    # Every child inherits one secret, so a `tessera up` deployment never runs unauthenticated.
    if not cluster_auth.secret():
        os.environ[cluster_auth.ENV] = secrets.token_hex(32)
    children, place = [], LOCAL
    with tempfile.TemporaryDirectory(prefix="tessera-up-") as scratch:
        if topology.registry:
            url = os.environ.get("REDIS_URL")
            if not url:
                redis, url = _redis_child(scratch)
                children.append(redis)
            print(f"tessera up: registry {url}", flush=True)
            place = replace(LOCAL, redis_url=url)
        grace = ["--shutdown-grace-s", f"{config.shutdown_grace_s:g}"]
        for p in topology.processes(place):
            if p.role == "redis":
                continue
            print(f"tessera up: {p.name} on port {p.port}: tessera {' '.join(p.argv)}", flush=True)
            argv = [*p.argv, *grace] if p.role in DRAINING_ROLES else list(p.argv)
            children.append(Child(p.name, p.role, tessera_argv(argv), essential=p.role not in HELPER_ROLES))
        return Supervisor(children, config, "tessera up").run()


def _redis_child(scratch: str) -> tuple[Child, str]:
    """A redis-server on a port chosen now, so that a restart comes back on the same port."""
    server = shutil.which("redis-server")
    if server is None:
        raise ConfigError("the topology has a redis role: set REDIS_URL or install redis-server")
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", scratch, "--loglevel", "warning"]
    # Not essential: without Redis the gateway keeps its last-known workers.
    return Child("redis-0", "redis", argv, essential=False), f"redis://127.0.0.1:{port}/0"
