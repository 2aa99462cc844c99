"""The gateway process: find the workers (a static list, or the registry), build the app
(app.py) with its admission (admission.py), and serve it with uvicorn until SIGTERM / Ctrl-C,
which stops accepting and gives in-flight requests (streams too) shutdown_grace_s to finish."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import time
from dataclasses import dataclass, field

from tessera import redis_conn
from tessera.config import ConfigError
from tessera.batch_jobs.config import BatchConfig
from tessera.entrypoints.gateway.admission import Admission, AdmissionConfig, digest
from tessera.gc_heap import freeze_startup_heap

# Flags of AdmissionConfig (help from its fields' comments; a new field gets --its-name).
# require_key follows from the keys given (with_keys).
ADMISSION_FLAGS = dict(
    names={"key_digests": "--api-key-sha256", "keys_from_redis": "--api-keys-from-redis"},
    exclude=("require_key",),
    helps={"key_digests": "accepted key, as its SHA-256 hex (repeatable)",
           "rpm": "default requests per minute per key (0: none)",
           "tpm": "default tokens per minute per key (0: none)"})


@dataclass(frozen=True)
class GatewayConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "HTTP port"})
    worker: tuple[str, ...] = field(default=(), metadata={
        "help": "worker gRPC address (repeat for several; default $TESSERA_WORKER or 127.0.0.1:50051)"})
    registry: str | None = field(default=None, metadata={
        "help": "Redis URL: route to the workers registered there (default $TESSERA_REGISTRY)"})
    registry_prefix: str = field(default="tessera", metadata={"help": "key prefix of this deployment in Redis"})
    served_model_name: str | None = field(default=None, metadata={"help": "model id (default: the worker's)"})
    wait_s: float = field(default=300.0, metadata={"help": "how long to wait for a first worker"})
    shutdown_grace_s: float = field(default=30.0, metadata={
        "help": "on SIGTERM / Ctrl-C: time in-flight requests get to finish"})
    stream_idle_timeout_s: float = field(default=300.0, metadata={
        "help": "a worker that sends nothing on a stream for this long is taken for failed "
                "(queueing and prefill included; no limit on a stream's total length)"})
    batch: BatchConfig = field(default_factory=BatchConfig)    # the Batch API's flags (--files-dir, ...)


def with_keys(config: AdmissionConfig, api_keys: list[str] | None) -> AdmissionConfig:
    """Add --api-key and $TESSERA_API_KEYS keys (kept only as SHA-256 digests); keys are
    required when any is given or keys come from Redis."""
    keys = [k for k in (api_keys or []) + os.environ.get("TESSERA_API_KEYS", "").split(",") if k]
    digests = tuple(dict.fromkeys(config.key_digests + tuple(digest(k) for k in keys)))
    return dataclasses.replace(config, key_digests=digests,
                               require_key=bool(digests) or config.keys_from_redis)


def main(config: GatewayConfig, admission: AdmissionConfig) -> int:
    import uvicorn

    from tessera.entrypoints.gateway.app import create_app
    from tessera.entrypoints.gateway.batch_api import BatchAPI
    from tessera.rpc.client import GrpcWorkerClient
    from tessera.worker_pool import WorkerPool

    registry_url = config.registry or os.environ.get("TESSERA_REGISTRY")

    def connect(address: str) -> GrpcWorkerClient:
        return GrpcWorkerClient(address, idle_timeout_s=config.stream_idle_timeout_s)
    if admission.keys_from_redis and not registry_url:
        raise SystemExit("--api-keys-from-redis needs --registry (the Redis URL)")
    listener = _listen(config.host, config.port)   # before waiting for workers: a taken port fails now
    background, client = [], None
    if registry_url:
        from tessera.registry import RedisRegistry
        registry = RedisRegistry(registry_url, prefix=config.registry_prefix)
        address, model = asyncio.run(_wait_for_registered(registry_url, config.registry_prefix,
                                                           config.served_model_name, config.wait_s))
        pool = WorkerPool(connect, [address])
        background.append(lambda: pool.watch(registry, model))
        client, source = pool, f"registry {redis_conn.split_password(registry_url)[0]}"   # no password in output
    else:
        workers = list(config.worker) or [os.environ.get("TESSERA_WORKER", "127.0.0.1:50051")]
        model = asyncio.run(_wait_for_worker(workers, config.wait_s)).model_id
        client = connect(workers[0]) if len(workers) == 1 else WorkerPool(connect, workers)
        source = ", ".join(workers)
    app = create_app(client, config.served_model_name or model, background,
                     Admission(admission, registry_url, config.registry_prefix),
                     BatchAPI.build(config.batch, registry_url, config.registry_prefix))
    freeze_startup_heap()
    print(f"tessera gateway on http://{config.host}:{config.port} -> {source} ({model})", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                           timeout_graceful_shutdown=config.shutdown_grace_s))
    server.run(sockets=[listener])
    return 0


def _listen(host: str, port: int) -> socket.socket:
    """The HTTP listening socket, bound here rather than by uvicorn so that a port in use is a
    ConfigError (exit 78, never restarted: a restart would find it taken again)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    return sock


async def _wait_for_registered(url: str, prefix: str, model: str | None, wait_s: float) -> tuple[str, str]:
    """(address, model) of the first registered worker that answers Info over mutual TLS: the
    model served is what a worker says, never what a record (anyone with Redis's password) says."""
    from tessera.registry import RedisRegistry, RegistryUnavailable, serving
    registry = RedisRegistry(url, prefix=prefix)
    deadline = time.monotonic() + wait_s
    try:
        while True:
            try:
                records = serving(await registry.list(model))
                if records:
                    info = await _first_answer([r.address for r in records])
                    if info is not None and (model is None or info[1] == model):
                        return info
            except RegistryUnavailable:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"no worker registered in {redis_conn.split_password(url)[0]} answered "
                                 f"within {wait_s:.0f} s")
            await asyncio.sleep(0.5)
    finally:
        await registry.close()


async def _first_answer(addresses: list[str]) -> tuple[str, str] | None:
    from tessera.rpc.client import GrpcWorkerClient
    from tessera.worker_api import WorkerError
    for address in addresses:
        client = GrpcWorkerClient(address)
        try:
            return address, (await client.info(timeout_s=2.0)).model_id
        except WorkerError:
            continue
        finally:
            await client.close()
    return None


async def _wait_for_worker(addresses: list[str], wait_s: float):
    """The first of the workers to answer Info (one that refuses the gateway is no answer)."""
    from tessera.rpc.client import GrpcWorkerClient
    from tessera.worker_api import WorkerError
    deadline, why = time.monotonic() + wait_s, {}
    while True:
        for address in addresses:
            client = GrpcWorkerClient(address)
            try:
                return await client.info(timeout_s=2.0)
            except WorkerError as e:
                why[address] = str(e)
            finally:
                await client.close()
        if time.monotonic() > deadline:
            raise SystemExit(f"no worker answered within {wait_s:.0f} s: "
                             + "; ".join(f"{a}: {w}" for a, w in why.items()))
        await asyncio.sleep(0.5)


def keys_add(registry: str, prefix: str, name: str, rpm: int, tpm: int) -> int:
    """Create an API key: its SHA-256 and limits go to Redis; the key is printed once."""
    async def add() -> str:
        admission = Admission(AdmissionConfig(), registry, prefix)
        try:
            return await admission.add_key(name, rpm, tpm)
        finally:
            await admission.close()
    print(asyncio.run(add()))
    return 0
