"""Worker discovery: each worker (monolithic worker or attention node) registers a record under
a key with a TTL and refreshes it by heartbeats; the gateway lists the records of its model.

    {prefix}:worker:{id} = JSON WorkerRecord, EX ttl_s

A worker that stops heartbeating disappears within ttl_s. While the registry is down, workers
keep retrying (their next heartbeat re-registers them) and the gateway keeps routing to the
members it last saw. RedisRegistry talks to a real Redis; MemoryRegistry is its in-process
twin with the same interface (and the same expiry semantics).
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass

from tessera import redis_conn

log = logging.getLogger("tessera.registry")
DEFAULT_TTL_S = 3.0
HEARTBEAT_S = 1.0


class RegistryUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class WorkerRecord:
    worker_id: str
    role: str            # worker | attention | draft | pipeline_shard (SERVING_ROLES take requests)
    model: str           # the served model id the gateway routes by
    address: str         # gRPC host:port
    capacity: int        # max running requests
    load: int = 0        # running + waiting at the last heartbeat
    version: str = ""    # compatibility hash (compatibility_hash): replicas a stream may move between


# Roles the gateway routes requests to; others register for discovery only (a draft worker
# answers draft rounds from its target, a later pipeline stage ("pipeline_shard") micro-batches
# from its stage 0, never a chat request).
SERVING_ROLES = frozenset({"worker", "attention"})


def serving(records: list[WorkerRecord]) -> list[WorkerRecord]:
    """The records of processes that serve requests."""
    return [r for r in records if r.role in SERVING_ROLES]


# Bump when the engine's numerics or sampling change (a resumed stream must draw as it would have).
ENGINE_VERSION = "tessera-engine-2"


def compatibility_hash(model: str, dtype: str, tokenizer: str = "", engine: str = ENGINE_VERSION,
                       protocol: str = "tessera.rpc.v1") -> str:
    """Two workers with the same hash produce the same tokens for the same request, so a
    stream may fail over between them: same model, dtype, tokenizer (a digest of its vocabulary
    and template), engine version and protocol."""
    return hashlib.sha256(f"{model}|{dtype}|{tokenizer}|{engine}|{protocol}".encode()).hexdigest()[:12]


class RedisRegistry:
    def __init__(self, url: str, prefix: str = "tessera", ttl_s: float = DEFAULT_TTL_S) -> None:
        self.client = redis_conn.connect(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self.prefix, self.ttl_s = prefix, ttl_s

    def _key(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    async def put(self, record: WorkerRecord) -> None:
        try:
            await self.client.set(self._key(record.worker_id), json.dumps(dataclasses.asdict(record)),
                                  px=int(self.ttl_s * 1000))
        except Exception as e:   # redis.exceptions.* and OSError: the registry is down
            raise RegistryUnavailable(str(e)) from e

    async def remove(self, worker_id: str) -> None:
        try:
            await self.client.delete(self._key(worker_id))
        except Exception as e:
            raise RegistryUnavailable(str(e)) from e

    async def list(self, model: str | None = None) -> list[WorkerRecord]:
        try:
            keys = [k async for k in self.client.scan_iter(match=f"{self.prefix}:worker:*", count=500)]
            values = await self.client.mget(keys) if keys else []
        except Exception as e:
            raise RegistryUnavailable(str(e)) from e
        records = [r for r in map(_parse, values) if r is not None]
        return sorted((r for r in records if model is None or r.model == model), key=lambda r: r.worker_id)

    async def close(self) -> None:
        await self.client.aclose()


def _parse(value: bytes | None) -> WorkerRecord | None:
    """A record, or None for a value that is not one (anyone holding Redis's password can write
    one): skipped, so one bad value never stops the gateway from following the others."""
    if value is None:
        return None
    try:
        record = WorkerRecord(**json.loads(value))
    except (TypeError, ValueError) as e:
        log.warning("skipping a registry value that is not a worker record: %s", e)
        return None
    if not all(isinstance(getattr(record, f), str) for f in ("worker_id", "role", "model", "address", "version")):
        log.warning("skipping a registry record with fields of the wrong type")
        return None
    return record


class MemoryRegistry:
    """In-process twin: the same records and expiry, in a dict."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.ttl_s = ttl_s
        self.records: dict[str, tuple[float, WorkerRecord]] = {}
        self.down = False     # tests flip it to play a registry outage

    def _check(self) -> None:
        if self.down:
            raise RegistryUnavailable("registry is down")

    async def put(self, record: WorkerRecord) -> None:
        self._check()
        self.records[record.worker_id] = (time.monotonic() + self.ttl_s, record)

    async def remove(self, worker_id: str) -> None:
        self._check()
        self.records.pop(worker_id, None)

    async def list(self, model: str | None = None) -> list[WorkerRecord]:
        self._check()
        now = time.monotonic()
        live = [r for expiry, r in self.records.values() if expiry > now]
        return sorted((r for r in live if model is None or r.model == model), key=lambda r: r.worker_id)

    async def close(self) -> None:
        pass


async def stay_registered(registry, worker_id: str, record_now) -> None:
    """Heartbeat record_now() until cancelled, then leave the registry (best effort) and close
    it: how every registering process holds its record."""
    try:
        await heartbeat(registry, record_now)
    finally:
        try:
            await registry.remove(worker_id)
        except Exception:
            pass
        await registry.close()


async def heartbeat(registry, record_now, interval_s: float = HEARTBEAT_S) -> None:
    """Put record_now() every interval_s until cancelled; outages are logged and retried."""
    warned = False
    while True:
        try:
            await registry.put(record_now())
            if warned:
                log.warning("registry is back: re-registered")
            warned = False
        except RegistryUnavailable as e:
            if not warned:
                log.warning("registry unavailable (%s); retrying every %.1f s", e, interval_s)
            warned = True
        await asyncio.sleep(interval_s)
