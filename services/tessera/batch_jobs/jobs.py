"""Batch job state: the record (OpenAI's Batch object plus counters, owner and the key whose
limits its lines are charged to), its statuses, and the store interface with its in-process
twin (MemoryJobStore; RedisJobStore in redis_jobs.py is the real one, same semantics).

    validating -> in_progress -> finalizing -> completed
         |              |   \\-> expired (past completion_window: unfinished lines fail)
         |              \\-> cancelling -> cancelled
         \\-> failed (the input file is malformed or gone)

A job runs where its lease is held: a key with a TTL that its runner renews. Each line's
output record is written once (the first write wins, and only under the lease), so a job
resumed by another gateway skips finished lines and its output holds each line exactly once.
"""
from __future__ import annotations

import time
import uuid

WINDOWS = {"24h": 24 * 3600}
TERMINAL = ("completed", "failed", "expired", "cancelled")
CANCELLABLE = ("validating", "in_progress")
COUNTERS = ("total", "completed", "failed")
PRIVATE = ("owner", "key", *COUNTERS)


class LeaseLost(Exception):
    """Another runner holds the job now: stop touching it."""


def new_batch(input_file_id: str, endpoint: str, window: str, metadata: dict | None, owner: str,
              key: dict | None) -> dict:
    now = int(time.time())
    times = dict.fromkeys(("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
                           "cancelling_at", "cancelled_at"))
    return {"id": f"batch_{uuid.uuid4().hex}", "object": "batch", "endpoint": endpoint, "errors": None,
            "input_file_id": input_file_id, "completion_window": window, "status": "validating",
            "output_file_id": None, "error_file_id": None, "created_at": now, "expires_at": now + WINDOWS[window],
            **times, "metadata": metadata, "total": 0, "completed": 0, "failed": 0, "owner": owner, "key": key}


def public(record: dict) -> dict:
    """The Batch object as OpenAI shows it."""
    out = {k: v for k, v in record.items() if k not in PRIVATE}
    out["request_counts"] = {k: record[k] for k in COUNTERS}
    return out


class MemoryJobStore:
    """In-process twin of RedisJobStore: one gateway's memory (jobs end with the process)."""

    def __init__(self) -> None:
        self.jobs: dict[str, dict] = {}
        self.results: dict[str, dict[int, dict]] = {}
        self.leases: dict[str, tuple[str, float]] = {}

    async def create(self, record: dict) -> None:
        self.jobs[record["id"]] = dict(record)

    async def get(self, batch_id: str) -> dict | None:
        record = self.jobs.get(batch_id)
        return dict(record) if record is not None else None

    async def list(self, owner: str, after: str | None, limit: int) -> tuple[list[dict], bool]:
        mine = [r for r in reversed(self.jobs.values()) if r["owner"] == owner]     # newest first
        ids = [r["id"] for r in mine]
        start = ids.index(after) + 1 if after in ids else 0
        return [dict(r) for r in mine[start:start + limit]], start + limit < len(mine)

    async def update(self, batch_id: str, allowed: tuple[str, ...], fields: dict, token: str | None = None) -> bool:
        """Set `fields` if the status is one of `allowed` (and, with a token, the lease is held)."""
        if token is not None and not self._holds(batch_id, token):
            raise LeaseLost(batch_id)
        record = self.jobs.get(batch_id)
        if record is None or record["status"] not in allowed:
            return False
        record.update(fields)
        return True

    async def active(self) -> list[str]:
        return [i for i, r in self.jobs.items() if r["status"] not in TERMINAL]

    def _holds(self, batch_id: str, token: str) -> bool:
        held = self.leases.get(batch_id)
        return held is not None and held[0] == token and held[1] > time.monotonic()

    async def acquire(self, batch_id: str, token: str, ttl_s: float) -> bool:
        held = self.leases.get(batch_id)
        if held is not None and held[1] > time.monotonic():
            return False
        self.leases[batch_id] = (token, time.monotonic() + ttl_s)
        return True

    async def renew(self, batch_id: str, token: str, ttl_s: float) -> bool:
        if not self._holds(batch_id, token):
            return False
        self.leases[batch_id] = (token, time.monotonic() + ttl_s)
        return True

    async def release(self, batch_id: str, token: str) -> None:
        if self._holds(batch_id, token):
            del self.leases[batch_id]

    async def record(self, batch_id: str, token: str, index: int, result: dict, counter: str) -> bool:
        """Keep line `index`'s result unless it has one; True when this call wrote it."""
        if not self._holds(batch_id, token):
            raise LeaseLost(batch_id)
        results = self.results.setdefault(batch_id, {})
        if index in results:
            return False
        results[index] = result
        self.jobs[batch_id][counter] += 1
        return True

    async def finished(self, batch_id: str) -> dict[int, dict]:
        return dict(self.results.get(batch_id, {}))

    async def done(self, batch_id: str) -> set[int]:
        return set(self.results.get(batch_id, {}))

    async def drop_results(self, batch_id: str) -> None:
        self.results.pop(batch_id, None)

    async def close(self) -> None:
        pass
