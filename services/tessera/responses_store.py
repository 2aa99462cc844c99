"""Stored responses of the Responses API (`store: true`): the Response object GET returns and
the conversation (input items and output, as chat messages) a `previous_response_id`
continues. Each record belongs to one owner, a SHA-256 of the API key that created it (never
the key): another owner's lookup finds nothing, so it cannot tell the id exists.

Two stores satisfy ResponseStore: Redis with a TTL when the gateway has Redis (every gateway
replica sees every response), else process memory bounded by bytes, least recently used first."""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class StoreConfig:
    ttl_s: int = 30 * 86400           # Redis: how long a response is kept (OpenAI keeps them 30 days)
    max_bytes: int = 256 << 20        # memory: total size of the records kept

    def __post_init__(self) -> None:
        if self.ttl_s < 1 or self.max_bytes < 1:
            raise ValueError("ttl_s and max_bytes must be positive")


@dataclass(frozen=True)
class StoredResponse:
    response: dict          # the Response object, as GET returns it
    conversation: list      # chat messages: the input so far and this response's output

    def dumps(self) -> str:
        return json.dumps({"response": self.response, "conversation": self.conversation}, ensure_ascii=False)

    @staticmethod
    def loads(raw: str | bytes) -> "StoredResponse":
        data = json.loads(raw)
        return StoredResponse(data["response"], data["conversation"])


class ResponseStore(Protocol):
    async def put(self, owner: str, record: StoredResponse) -> None: ...

    async def get(self, owner: str, response_id: str) -> StoredResponse | None: ...

    async def delete(self, owner: str, response_id: str) -> bool: ...


class MemoryResponseStore:
    """Records as JSON text (their size is what is bounded), least recently used evicted first."""

    def __init__(self, config: StoreConfig = StoreConfig()) -> None:
        self.config = config
        self._records: OrderedDict[tuple[str, str], str] = OrderedDict()
        self.bytes = 0

    async def put(self, owner: str, record: StoredResponse) -> None:
        raw = record.dumps()
        if len(raw) > self.config.max_bytes:
            raise ValueError(f"a stored response of {len(raw)} bytes exceeds the store's {self.config.max_bytes}")
        key = (owner, record.response["id"])
        self.bytes -= len(self._records.pop(key, ""))
        self._records[key] = raw
        self.bytes += len(raw)
        while self.bytes > self.config.max_bytes:
            self.bytes -= len(self._records.popitem(last=False)[1])

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        raw = self._records.get((owner, response_id))
        if raw is None:
            return None
        self._records.move_to_end((owner, response_id))
        return StoredResponse.loads(raw)

    async def delete(self, owner: str, response_id: str) -> bool:
        raw = self._records.pop((owner, response_id), None)
        self.bytes -= len(raw or "")
        return raw is not None


class RedisResponseStore:
    """One key per record, `{prefix}:response:{owner}:{id}`, expiring after ttl_s. The owner is
    in the key, so a lookup under another owner misses like an unknown id."""

    def __init__(self, redis, prefix: str, config: StoreConfig = StoreConfig()) -> None:
        self.redis, self.prefix, self.config = redis, prefix, config

    def key(self, owner: str, response_id: str) -> str:
        return f"{self.prefix}:response:{owner}:{response_id}"

    async def put(self, owner: str, record: StoredResponse) -> None:
        await self.redis.set(self.key(owner, record.response["id"]), record.dumps(), ex=self.config.ttl_s)

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        raw = await self.redis.get(self.key(owner, response_id))
        return None if raw is None else StoredResponse.loads(raw)

    async def delete(self, owner: str, response_id: str) -> bool:
        return bool(await self.redis.delete(self.key(owner, response_id)))
