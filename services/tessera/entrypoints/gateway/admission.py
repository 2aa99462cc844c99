"""Admission at the gateway, checked in this order before a request reaches a worker:

1. body size: larger than max_body_bytes -> 413 (checked on Content-Length and while reading);
2. API key (optional): `Authorization: Bearer KEY`; keys are kept only as SHA-256 digests, from
   the command line / environment or from Redis (`{prefix}:apikey:{sha256}` = JSON
   {"name", "rpm", "tpm"}, written by `tessera keys add`); a missing or unknown key -> 401;
3. per-key limits: requests and tokens per minute, counted atomically in Redis (one Lua script
   per request: check both counters, then count the request) -> 429 with Retry-After; tokens are
   charged when the request ends (prompt + completion, from the usage the worker reports);
4. the gateway's own bound: at most max_inflight requests in flight -> 503 with Retry-After;
   past the workers' bounded queues they answer Saturated, also 503 with Retry-After.

With Redis down, known keys stay valid (last lookup cached) and limits are not enforced
(fail open), so a registry outage never fails requests; unknown keys get 503, not 401.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
from dataclasses import dataclass

from tessera.openai_api.errors import APIError

log = logging.getLogger("tessera.admission")
WINDOW_S = 60
KEY_CACHE_S = 10.0

# KEYS: request counter, token counter of this key's current minute. ARGV: rpm, tpm (0: none).
# Returns 0 when admitted (and counts the request), else 1 (requests) or 2 (tokens).
_ADMIT = """
local r = tonumber(redis.call('GET', KEYS[1]) or '0')
local t = tonumber(redis.call('GET', KEYS[2]) or '0')
if tonumber(ARGV[1]) > 0 and r >= tonumber(ARGV[1]) then return 1 end
if tonumber(ARGV[2]) > 0 and t >= tonumber(ARGV[2]) then return 2 end
redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], 2 * tonumber(ARGV[3]))
return 0
"""


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return "sk-tessera-" + secrets.token_urlsafe(24)


@dataclass(frozen=True)
class KeyInfo:
    name: str
    rpm: int = 0        # requests per minute; 0: unlimited
    tpm: int = 0        # tokens per minute; 0: unlimited


@dataclass(frozen=True)
class AdmissionConfig:
    max_inflight: int = 256
    max_body_bytes: int = 1 << 20
    require_key: bool = False
    key_digests: tuple[str, ...] = ()      # SHA-256 hex of accepted keys (from flags / environment)
    rpm: int = 0                           # default limits for keys that carry none
    tpm: int = 0


class Admission:
    def __init__(self, config: AdmissionConfig, redis_url: str | None = None, prefix: str = "tessera") -> None:
        self.config, self.prefix = config, prefix
        self.inflight = 0
        self.rejected = {"413": 0, "401": 0, "429": 0, "503": 0}
        self._keys: dict[str, tuple[KeyInfo | None, float]] = {
            d: (KeyInfo(f"key-{d[:8]}", config.rpm, config.tpm), float("inf")) for d in config.key_digests}
        self.redis = None
        if redis_url:
            import redis.asyncio as redis
            self.redis = redis.Redis.from_url(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
            self._admit = self.redis.register_script(_ADMIT)

    def reject(self, status: int, message: str, code: str, retry_after: float | None = None) -> APIError:
        self.rejected[str(status)] += 1
        return APIError(status, message, None, code, retry_after)

    async def admit(self, authorization: str | None) -> "Ticket":
        """Raise APIError (401/429/503) or return a ticket to release when the request ends."""
        key = await self._authenticate(authorization) if self.config.require_key else None
        if key is not None and (key.rpm or key.tpm):
            await self._check_limits(key)
        if self.inflight >= self.config.max_inflight:
            raise self.reject(503, f"The server is at capacity ({self.inflight} requests in flight); retry later.",
                              "server_overloaded", 1)
        self.inflight += 1
        return Ticket(self, key)

    async def _authenticate(self, authorization: str | None) -> KeyInfo:
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise self.reject(401, "Missing API key: send 'Authorization: Bearer <key>'.", "invalid_api_key")
        d = digest(token.strip())
        cached = self._keys.get(d)
        if cached is not None and cached[1] > time.monotonic():
            info = cached[0]
        else:
            info = await self._lookup(d, cached)
        if info is None:
            raise self.reject(401, "Incorrect API key provided.", "invalid_api_key")
        return info

    async def _lookup(self, d: str, cached) -> KeyInfo | None:
        if self.redis is None:
            return None
        try:
            raw = await self.redis.get(f"{self.prefix}:apikey:{d}")
        except Exception as e:   # Redis down: last-known answer, else "try again"
            if cached is not None:
                return cached[0]
            log.warning("API key lookup failed: %s", e)
            raise self.reject(503, "Cannot verify the API key right now; retry later.", "auth_unavailable", 2)
        info = None
        if raw is not None:
            data = json.loads(raw)
            info = KeyInfo(data.get("name", d[:8]), int(data.get("rpm") or self.config.rpm),
                           int(data.get("tpm") or self.config.tpm))
        self._keys[d] = (info, time.monotonic() + KEY_CACHE_S)
        return info

    def _window_keys(self, key: KeyInfo) -> tuple[list[str], float]:
        window = int(time.time() // WINDOW_S)
        base = f"{self.prefix}:limit:{key.name}:{window}"
        return [f"{base}:requests", f"{base}:tokens"], WINDOW_S - time.time() % WINDOW_S

    async def _check_limits(self, key: KeyInfo) -> None:
        if self.redis is None:
            return
        keys, retry = self._window_keys(key)
        try:
            verdict = await self._admit(keys=keys, args=[key.rpm, key.tpm, WINDOW_S])
        except Exception as e:
            log.warning("rate limit check failed (admitting): %s", e)
            return
        if verdict:
            what = "requests" if verdict == 1 else "tokens"
            limit = key.rpm if verdict == 1 else key.tpm
            raise self.reject(429, f"Rate limit reached for {key.name}: {limit} {what} per minute.",
                              "rate_limit_exceeded", max(1, round(retry)))

    async def charge(self, key: KeyInfo, tokens: int) -> None:
        if self.redis is None or not key.tpm or tokens <= 0:
            return
        keys, _ = self._window_keys(key)
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                await pipe.incrby(keys[1], tokens).expire(keys[1], 2 * WINDOW_S).execute()
        except Exception as e:
            log.warning("token accounting failed: %s", e)

    async def add_key(self, name: str, rpm: int = 0, tpm: int = 0) -> str:
        """Store a new key's digest with its limits; returns the key (shown once, never stored)."""
        key = new_key()
        await self.redis.set(f"{self.prefix}:apikey:{digest(key)}", json.dumps({"name": name, "rpm": rpm, "tpm": tpm}))
        return key

    async def close(self) -> None:
        if self.redis is not None:
            await self.redis.aclose()


class Ticket:
    """One admitted request: release() once it ends, with the tokens it used."""

    def __init__(self, admission: Admission, key: KeyInfo | None) -> None:
        self.admission, self.key, self.tokens, self._open = admission, key, 0, True

    def release(self) -> None:
        if not self._open:
            return
        self._open = False
        self.admission.inflight -= 1
        if self.key is not None and self.tokens:
            asyncio.get_running_loop().create_task(self.admission.charge(self.key, self.tokens))

    def __del__(self) -> None:
        # A stream whose response never started (client gone first) drops its generator
        # unstarted, so no finally ran: give the in-flight slot back here.
        if self._open:
            self._open = False
            self.admission.inflight -= 1
