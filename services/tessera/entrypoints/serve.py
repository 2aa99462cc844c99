"""`tessera serve`: a worker and a gateway in front of it, as two processes under a Supervisor
(deploy/supervisor.py): a worker that dies is restarted while the gateway keeps running, and
SIGTERM / Ctrl-C drains both. Each process gets its settings as the flags that rebuild the
same config dataclasses (flags.to_argv), so `serve`, `worker` and `gateway` cannot drift apart."""
from __future__ import annotations

from dataclasses import replace

from tessera.config import ConfigError, EngineConfig
from tessera.deploy.supervisor import Child, Supervisor, SupervisorConfig, tessera_argv
from tessera.entrypoints.flags import to_argv
from tessera.entrypoints.gateway.admission import AdmissionConfig
from tessera.entrypoints.gateway.main import ADMISSION_FLAGS, GatewayConfig

# GatewayConfig fields `serve` sets itself rather than taking as flags.
GATEWAY_FIELDS_SET_BY_SERVE = ("worker", "registry", "registry_prefix", "shutdown_grace_s")


def process_args(engine: EngineConfig, gateway: GatewayConfig, admission: AdmissionConfig, worker_port: int,
                 grace_s: float) -> tuple[list[str], list[str]]:
    """The `tessera worker ...` and `tessera gateway ...` arguments."""
    if admission.keys_from_redis:
        raise ConfigError("serve runs no Redis: keys from Redis need `tessera up` with a redis role")
    worker = ["worker", "--host", "127.0.0.1", "--port", str(worker_port), *to_argv(engine),
              "--shutdown-grace-s", f"{grace_s:g}"]
    gateway = replace(gateway, worker=(f"127.0.0.1:{worker_port}",), shutdown_grace_s=grace_s)
    return worker, ["gateway", *to_argv(gateway), *to_argv(admission, **ADMISSION_FLAGS)]


def main(engine: EngineConfig, gateway: GatewayConfig, admission: AdmissionConfig, worker_port: int,
         supervisor: SupervisorConfig = SupervisorConfig()) -> int:
    worker_args, gateway_args = process_args(engine, gateway, admission, worker_port, supervisor.shutdown_grace_s)
    children = [Child("worker-0", "worker", tessera_argv(worker_args)),
                Child("gateway-0", "gateway", tessera_argv(gateway_args))]
    return Supervisor(children, supervisor, "tessera serve").run()
