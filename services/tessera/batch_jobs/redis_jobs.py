"""RedisJobStore: batch job state in the gateways' Redis (MemoryJobStore in jobs.py is its
in-process twin). Keys, under the deployment's prefix:

    {prefix}:batch:{id}          hash: the record's fields, each JSON-encoded
    {prefix}:batch:{id}:results  hash: line index -> output record (written once, under the lease)
    {prefix}:batch:{id}:lease    the runner's token, with a TTL it renews
    {prefix}:batches:{owner}     sorted set: the owner's batches by creation time (listing)
    {prefix}:batches:active      set: batches not yet in a final status (what runners pick from)

Every check-then-write is one Lua script, so gateways sharing the Redis cannot interleave.
With appendonly (the rendered compose / Kubernetes Redis) jobs survive a Redis restart.
"""
from __future__ import annotations

import json
import time

from tessera import redis_conn
from tessera.batch_jobs.jobs import TERMINAL, LeaseLost

# KEYS: job, active set, lease. ARGV: id, token ('' = no lease check), terminal flag, number of
# allowed statuses, the allowed statuses, then field, value pairs. -1: lease lost; 0: refused.
_UPDATE = """
if ARGV[2] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[2] then return -1 end
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 0 end
local n, ok = tonumber(ARGV[4]), false
for i = 5, 4 + n do if ARGV[i] == status then ok = true end end
if not ok then return 0 end
for i = 5 + n, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
if ARGV[3] == '1' then redis.call('SREM', KEYS[2], ARGV[1]) end
return 1
"""
# KEYS: lease, results, job. ARGV: token, line index, record, counter field. -1: lease lost.
_RECORD = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if redis.call('HSETNX', KEYS[2], ARGV[2], ARGV[3]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[3], ARGV[4], 1)
return 1
"""
_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisJobStore:
    def __init__(self, url: str, prefix: str = "tessera") -> None:
        self.redis = redis_conn.connect(url, socket_timeout=5.0, socket_connect_timeout=2.0)
        self.prefix = prefix
        self._update, self._record = self.redis.register_script(_UPDATE), self.redis.register_script(_RECORD)
        self._renew, self._release = self.redis.register_script(_RENEW), self.redis.register_script(_RELEASE)

    def _key(self, batch_id: str, part: str = "") -> str:
        return f"{self.prefix}:batch:{batch_id}{part}"

    def _owned(self, owner: str) -> str:
        return f"{self.prefix}:batches:{owner}"

    async def create(self, record: dict) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._key(record["id"]), mapping={k: json.dumps(v) for k, v in record.items()})
            pipe.zadd(self._owned(record["owner"]), {record["id"]: time.time()})   # finer than created_at
            pipe.sadd(f"{self.prefix}:batches:active", record["id"])
            await pipe.execute()

    async def get(self, batch_id: str) -> dict | None:
        raw = await self.redis.hgetall(self._key(batch_id))
        return {k.decode(): json.loads(v) for k, v in raw.items()} or None

    async def list(self, owner: str, after: str | None, limit: int) -> tuple[list[dict], bool]:
        """The owner's batches, newest first, from the one after `after`."""
        key = self._owned(owner)
        rank = await self.redis.zrevrank(key, after) if after else None
        start = 0 if rank is None else rank + 1
        ids = await self.redis.zrevrange(key, start, start + limit)
        records = [await self.get(i.decode()) for i in ids[:limit]]
        return [r for r in records if r is not None], len(ids) > limit

    async def update(self, batch_id: str, allowed: tuple[str, ...], fields: dict, token: str | None = None) -> bool:
        terminal = "1" if fields.get("status") in TERMINAL else "0"
        pairs = [x for k, v in fields.items() for x in (k, json.dumps(v))]
        done = await self._update(keys=[self._key(batch_id), f"{self.prefix}:batches:active",
                                        self._key(batch_id, ":lease")],
                                  args=[batch_id, token or "", terminal, len(allowed),
                                        *(json.dumps(s) for s in allowed), *pairs])
        if done == -1:
            raise LeaseLost(batch_id)
        return done == 1

    async def active(self) -> list[str]:
        return sorted(i.decode() for i in await self.redis.smembers(f"{self.prefix}:batches:active"))

    async def acquire(self, batch_id: str, token: str, ttl_s: float) -> bool:
        return bool(await self.redis.set(self._key(batch_id, ":lease"), token, nx=True, px=int(ttl_s * 1000)))

    async def renew(self, batch_id: str, token: str, ttl_s: float) -> bool:
        return bool(await self._renew(keys=[self._key(batch_id, ":lease")], args=[token, int(ttl_s * 1000)]))

    async def release(self, batch_id: str, token: str) -> None:
        await self._release(keys=[self._key(batch_id, ":lease")], args=[token])

    async def record(self, batch_id: str, token: str, index: int, result: dict, counter: str) -> bool:
        done = await self._record(keys=[self._key(batch_id, ":lease"), self._key(batch_id, ":results"),
                                        self._key(batch_id)], args=[token, index, json.dumps(result), counter])
        if done == -1:
            raise LeaseLost(batch_id)
        return done == 1

    async def finished(self, batch_id: str) -> dict[int, dict]:
        raw = await self.redis.hgetall(self._key(batch_id, ":results"))
        return {int(k): json.loads(v) for k, v in raw.items()}

    async def done(self, batch_id: str) -> set[int]:
        return {int(k) for k in await self.redis.hkeys(self._key(batch_id, ":results"))}

    async def drop_results(self, batch_id: str) -> None:
        await self.redis.delete(self._key(batch_id, ":results"))

    async def close(self) -> None:
        await self.redis.aclose()
