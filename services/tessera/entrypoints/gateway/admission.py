"""Admission at the gateway, checked in this order before a request reaches a worker:

1. body size: larger than max_body_bytes -> 413 (checked on Content-Length and while reading);
2. API key (optional), before any validation or model lookup, so that a caller without a key
   learns nothing about the API: `Authorization: Bearer KEY`; keys are kept only as SHA-256
   digests, from the command line / environment or, with keys_from_redis, from Redis
   (`{prefix}:apikey:{sha256}` = JSON {"name", "rpm", "tpm"}, written by `tessera keys add`;
   a limit of 0 is "unlimited", a missing one the gateway's default);
   a missing or unknown key -> 401. Unknown keys are cached negatively in a bounded LRU, and a
   client address with too many failed attempts a minute gets 429 (the X-Forwarded-For address
   only when the direct peer is a configured trusted proxy);
3. per-key limits: requests and tokens per minute, counted atomically in Redis (one Lua script
   per request: check both counters, then count the request's generations) -> 429 with
   Retry-After; tokens are charged when the request ends (prompt + completion of every choice).
   Counters are kept per key (its digest), not per name: names are labels, and two keys may
   share one;
4. the gateway's own bound: at most max_inflight generations in flight (a request with n
   choices or several prompts counts each) -> 503 with Retry-After; past the workers' bounded
   queues they answer Saturated, also 503 with Retry-After.

With Redis down, known keys stay valid (last lookup cached) and limits are not enforced
(fail open), so a registry outage never fails requests; unknown keys get 503, not 401.

rules(key) gives the request parsing (openai_api.params) the caps on a body's lists and, with
cache_salt_by_key, the key's prefix-cache namespace: the prefix cache is shared by every
caller, and cached_tokens would otherwise tell one tenant what another sent.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass

from tessera import redis_conn, tracing
from tessera.openai_api.errors import APIError
from tessera.openai_api.params import RequestRules

log = logging.getLogger("tessera.admission")
WINDOW_S = 60
KEY_CACHE_S = 10.0

# KEYS: request counter, token counter of this key's current minute. ARGV: rpm, tpm (0: none),
# window, cost (generations). Returns 0 when admitted (and counts them), else 1 (requests) or
# 2 (tokens).
_ADMIT = """
local r = tonumber(redis.call('GET', KEYS[1]) or '0')
local t = tonumber(redis.call('GET', KEYS[2]) or '0')
if tonumber(ARGV[1]) > 0 and r + tonumber(ARGV[4]) > tonumber(ARGV[1]) then return 1 end
if tonumber(ARGV[2]) > 0 and t >= tonumber(ARGV[2]) then return 2 end
redis.call('INCRBY', KEYS[1], ARGV[4])
redis.call('EXPIRE', KEYS[1], 2 * tonumber(ARGV[3]))
return 0
"""


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return "sk-tessera-" + secrets.token_urlsafe(24)


@dataclass(frozen=True)
class KeyInfo:
    name: str           # a label: not unique
    rpm: int = 0        # requests per minute; 0: unlimited
    tpm: int = 0        # tokens per minute; 0: unlimited
    id: str = ""        # the key's SHA-256 (what Redis stores it under); "" only in a batch job
                        # recorded before keys had ids: its counters are then its name's

    @property
    def counter_id(self) -> str:
        return self.id or f"name:{self.name}"


@dataclass(frozen=True)
class AdmissionConfig:
    max_inflight: int = 256                # generations in flight before 503 + Retry-After
    max_body_bytes: int = 1 << 20          # larger request bodies get 413
    require_key: bool = False
    key_digests: tuple[str, ...] = ()      # SHA-256 hex of accepted keys (from flags / environment)
    rpm: int = 0                           # default limits for keys that carry none
    tpm: int = 0
    keys_from_redis: bool = False          # also accept keys stored in Redis (`tessera keys add`)
    max_choices: int = 64                  # generations one request may ask for (prompts x n)
    auth_failures_per_min: int = 30        # failed key attempts per client address, then 429
    trusted_proxies: tuple[str, ...] = ()  # peers whose X-Forwarded-For names the client
    key_cache_size: int = 10000            # known and unknown keys remembered (LRU)
    max_messages: int = RequestRules.max_messages               # chat messages one request may send
    max_logit_bias: int = RequestRules.max_logit_bias           # logit_bias entries one request may send
    max_stop_token_ids: int = RequestRules.max_stop_token_ids   # stop_token_ids one request may send
    cache_salt_by_key: bool = True         # with API keys: each key its own prefix-cache namespace


class Admission:
    def __init__(self, config: AdmissionConfig, redis_url: str | None = None, prefix: str = "tessera") -> None:
        self.config, self.prefix = config, prefix
        self.inflight = 0
        self.rejected = {"413": 0, "401": 0, "429": 0, "503": 0}
        self._static = {d: KeyInfo(f"key-{d[:8]}", config.rpm, config.tpm, d) for d in config.key_digests}
        self._keys: OrderedDict[str, tuple[KeyInfo | None, float]] = OrderedDict()   # Redis lookups (LRU)
        self._failures: OrderedDict[str, tuple[int, float]] = OrderedDict()  # address -> (count, window)
        self.redis = None
        if redis_url:
            self.redis = redis_conn.connect(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
            self._admit = self.redis.register_script(_ADMIT)

    def reject(self, status: int, message: str, code: str, retry_after: float | None = None) -> APIError:
        self.rejected[str(status)] += 1
        return APIError(status, message, None, code, retry_after)

    async def authenticate(self, authorization: str | None, client: str) -> KeyInfo | None:
        """The caller's key (None when keys are off); raise 401, or 429 for an address that keeps
        failing. `client` is the caller's address (client_address())."""
        if not self.config.require_key:
            return None
        count, window = self._failures.get(client, (0, 0.0))
        now = time.monotonic()
        if count >= self.config.auth_failures_per_min and now - window < WINDOW_S:
            raise self.reject(429, "Too many failed authentication attempts; retry later.",
                              "rate_limit_exceeded", max(1, round(WINDOW_S - (now - window))))
        try:
            with tracing.span("authentication"):
                return await self._authenticate(authorization)
        except APIError as e:
            if e.status == 401:
                self._remember(self._failures, client, (count + 1 if now - window < WINDOW_S else 1,
                                                        window if now - window < WINDOW_S else now))
            raise

    def rules(self, key: KeyInfo | None) -> RequestRules:
        """The caps on a request's lists, and its prefix-cache tenant: the key's id when
        cache_salt_by_key (the worker sees only a digest of it, params.cache_salt)."""
        c = self.config
        tenant = key.counter_id if key is not None and c.cache_salt_by_key else None
        return RequestRules(c.max_messages, c.max_logit_bias, c.max_stop_token_ids, tenant)

    def client_address(self, peer: str | None, forwarded_for: str | None) -> str:
        """The peer, or the X-Forwarded-For client when the peer is a trusted proxy."""
        if forwarded_for and peer in self.config.trusted_proxies:
            return forwarded_for.split(",")[0].strip()
        return peer or "unknown"

    async def admit(self, key: KeyInfo | None, cost: int = 1) -> "Ticket":
        """Rate limits and the in-flight bound for `cost` generations: raise APIError (429/503)
        or return a ticket to release when the request ends."""
        with tracing.span("admission", **{"tessera.generations": cost}):
            if key is not None and (key.rpm or key.tpm):
                await self._check_limits(key, cost)
            return self.hold(cost, key)

    def hold(self, cost: int = 1, key: KeyInfo | None = None) -> "Ticket":
        """Only the in-flight bound (the deep health probe is bounded by it too)."""
        if self.inflight + cost > self.config.max_inflight:
            raise self.reject(503, f"The server is at capacity ({self.inflight} generations in flight); "
                              "retry later.", "server_overloaded", 1)
        self.inflight += cost
        return Ticket(self, key, cost)

    async def _authenticate(self, authorization: str | None) -> KeyInfo:
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise self.reject(401, "Missing API key: send 'Authorization: Bearer <key>'.", "invalid_api_key")
        d = digest(token.strip())
        info = self._static.get(d)
        if info is None and self.config.keys_from_redis:
            cached = self._keys.get(d)
            info = cached[0] if cached is not None and cached[1] > time.monotonic() else await self._lookup(d, cached)
        if info is None:
            raise self.reject(401, "Incorrect API key provided.", "invalid_api_key")
        return info

    def _remember(self, cache: OrderedDict, key: str, value) -> None:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > self.config.key_cache_size:
            cache.popitem(last=False)

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
            info = KeyInfo(data.get("name", d[:8]), self._limit(data, "rpm"), self._limit(data, "tpm"), d)
        self._remember(self._keys, d, (info, time.monotonic() + KEY_CACHE_S))
        return info

    def _limit(self, data: dict, name: str) -> int:
        """A stored limit: 0 is unlimited; absent (null) is the gateway's default."""
        value = data.get(name)
        return getattr(self.config, name) if value is None else int(value)

    def _window_keys(self, key: KeyInfo) -> tuple[list[str], float]:
        window = int(time.time() // WINDOW_S)
        base = f"{self.prefix}:limit:{key.counter_id}:{window}"
        return [f"{base}:requests", f"{base}:tokens"], WINDOW_S - time.time() % WINDOW_S

    async def _check_limits(self, key: KeyInfo, cost: int) -> None:
        if self.redis is None:
            return
        keys, retry = self._window_keys(key)
        try:
            verdict = await self._admit(keys=keys, args=[key.rpm, key.tpm, WINDOW_S, cost])
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

    async def add_key(self, name: str, rpm: int | None = None, tpm: int | None = None) -> str:
        """Store a new key's digest with its limits (0: unlimited; None: the gateway's
        default); returns the key (shown once, never stored)."""
        key = new_key()
        await self.redis.set(f"{self.prefix}:apikey:{digest(key)}", json.dumps({"name": name, "rpm": rpm, "tpm": tpm}))
        return key

    async def close(self) -> None:
        if self.redis is not None:
            await self.redis.aclose()


class Ticket:
    """One admitted request (`cost` generations): release() once it ends, with the tokens it used."""

    def __init__(self, admission: Admission, key: KeyInfo | None, cost: int = 1) -> None:
        self.admission, self.key, self.cost, self.tokens, self._open = admission, key, cost, 0, True

    def release(self) -> None:
        if not self._open:
            return
        self._open = False
        self.admission.inflight -= self.cost
        if self.key is not None and self.tokens:
            asyncio.get_running_loop().create_task(self.admission.charge(self.key, self.tokens))

    def __del__(self) -> None:
        # A stream whose response never started (client gone first) drops its generator
        # unstarted, so no finally ran: give the in-flight slot back here.
        if self._open:
            self._open = False
            self.admission.inflight -= self.cost
