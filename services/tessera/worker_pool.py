"""WorkerPool: one WorkerClient over several workers of the same model (replicas of a
monolithic worker, or the M attention nodes of an AFD deployment).

Routing: each request goes to the live member with the fewest requests in flight from this
gateway. Failover (as Dynamo's migration): when a worker dies mid-request (Unavailable), the
request goes on on another member with the same compatibility hash, carrying its state (the
output tokens so far, which count as output for penalties, limits and seeded draws, and how
much text the client got), so the client's stream continues exactly as it would have. A full
worker (Saturated) is skipped without being marked down, before the first token or after (the
stream resumes on the next member); one that refuses this gateway (Misconfigured: a wrong token
or certificate, a stale process on its port) is logged and out of rotation for REFUSED_FOR_S;
an internal error (500) is never replayed. If no member is left, the request ends with the last
error (a 503 with Retry-After). Membership is static (addresses) or follows a registry
(watch()); during a registry outage, or when it suddenly lists none, the last-known members stay.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import AsyncIterator, Callable

from tessera import tracing
from tessera.request import Resume
from tessera.worker_api import (GenerateChunk, GenerateInput, InvalidRequest, Misconfigured, Saturated, Tokenized,
                                TokenizeInput, Unavailable, WorkerClient, WorkerError, WorkerInfo)

log = logging.getLogger("tessera.pool")
DOWN_FOR_S = 5.0    # a member that failed is skipped this long (or until the registry drops it)
# A member that refuses this gateway (Misconfigured) is skipped longer: only an operator fixes it
# (a stale process on the port, another deployment's certificate); then it is tried again.
REFUSED_FOR_S = 60.0


class WorkerPool:
    def __init__(self, make_client: Callable[[str], WorkerClient], addresses: list[str] = ()) -> None:
        self.make_client = make_client
        self.clients: dict[str, WorkerClient] = {}
        self.outstanding: dict[str, int] = {}
        self.down_until: dict[str, float] = {}
        self._owner: dict[str, tuple[str, str]] = {}     # request id -> (address, attempt id)
        self.failovers = 0
        self.routed: dict[str, int] = {}                  # attempts sent to each address
        self.compat: dict[str, str] = {}                  # address -> compatibility hash
        self.set_members(list(addresses))

    def set_members(self, addresses: list[str]) -> None:
        for address in addresses:
            if address not in self.clients:
                self.clients[address] = self.make_client(address)
                self.outstanding[address] = 0
        for address in [a for a in self.clients if a not in addresses and not self.outstanding[a]]:
            del self.clients[address], self.outstanding[address]
            self.compat.pop(address, None)

    @property
    def members(self) -> list[str]:
        return list(self.clients)

    def _pick(self, exclude: set[str], compat: str | None) -> str | None:
        now = time.monotonic()
        live = [a for a in self.clients if a not in exclude and self.down_until.get(a, 0) <= now
                and (compat is None or self.compat.get(a, compat) == compat)]
        return min(live, key=lambda a: self.outstanding[a]) if live else None

    async def generate(self, request: GenerateInput) -> AsyncIterator[GenerateChunk]:
        """Stream from the least-loaded member; on a worker failure go on elsewhere with the
        generation's state (Resume), so the client sees one uninterrupted stream."""
        tried: set[str] = set()
        state = _Progress()
        error: WorkerError = Unavailable("no worker is available for this model")
        while (address := self._pick(tried, state.compat)) is not None:
            tried.add(address)
            # counted before the first await: requests arriving together spread over the members
            self.outstanding[address] += 1
            try:
                compat = await self._compat(address)
            except BaseException:
                self.outstanding[address] -= 1
                raise
            if state.compat and compat != state.compat:   # a resumed stream only moves between equals
                self.outstanding[address] -= 1
                continue
            state.compat = state.compat or compat
            self.routed[address] = self.routed.get(address, 0) + 1
            attempt = state.attempt(request, len(tried))
            self._owner[request.request_id] = (address, attempt.request_id)
            try:
                async for chunk in self.clients[address].generate(attempt):
                    yield state.seen(chunk)
                return
            except Saturated as e:      # back-pressure: try another member, mark nobody down
                error = e
                if state.generated:     # a stream resumed here: it goes on on the next member
                    self.failovers += 1
                    _cut(address, e, state)
                    log.warning("request %s: %s is full (%s); resuming on another worker", request.request_id,
                                address, e)
            except Misconfigured as e:
                error = Unavailable("no worker is available for this model")   # the details are for the log
                self.down_until[address] = time.monotonic() + REFUSED_FOR_S
                self.compat.pop(address, None)
                self.failovers += bool(state.generated)
                log.error("worker %s out of rotation for %.0f s: %s", address, REFUSED_FOR_S, e)
            except Unavailable as e:
                error = e
                self.down_until[address] = time.monotonic() + DOWN_FOR_S
                self.compat.pop(address, None)    # what answers there next is asked again
                self.failovers += 1
                _cut(address, e, state)
                log.warning("request %s: %s failed (%s); resuming on another worker", request.request_id,
                            address, e)
            finally:
                self.outstanding[address] -= 1
                self._owner.pop(request.request_id, None)
        raise error

    async def _compat(self, address: str) -> str | None:
        """The member's compatibility hash, asked of the member itself over mutual TLS (never
        taken from a registry record, which anyone holding Redis's password can write), once
        per address until a call to it fails."""
        if address not in self.compat:
            try:
                self.compat[address] = (await self.clients[address].info(timeout_s=2.0)).compat or ""
            except WorkerError:
                return None
        return self.compat[address] or None

    async def abort(self, request_id: str) -> None:
        owner = self._owner.get(request_id)
        if owner is not None:
            await self.clients[owner[0]].abort(owner[1])

    async def info(self, timeout_s: float = 5.0) -> WorkerInfo:
        return await self._any(lambda c: c.info(timeout_s=timeout_s))

    async def tokenize(self, request: TokenizeInput, timeout_s: float = 30.0) -> Tokenized:
        return await self._any(lambda c: c.tokenize(request, timeout_s))

    async def detokenize(self, token_ids: tuple[int, ...], timeout_s: float = 30.0) -> str:
        return await self._any(lambda c: c.detokenize(token_ids, timeout_s))

    async def _any(self, call):
        """call(client) on the first member that answers (they serve the same model), those
        not known to be down first; a refusal of the request itself (InvalidRequest) is the
        answer, not a reason to ask another."""
        error: WorkerError = Unavailable("no worker is available")
        now = time.monotonic()
        members = sorted(self.clients, key=lambda a: self.down_until.get(a, 0) > now)
        for client in [self.clients[a] for a in members]:
            try:
                return await call(client)
            except InvalidRequest:
                raise
            except WorkerError as e:
                error = e
        raise error

    async def watch(self, registry, model: str, interval_s: float = 1.0) -> None:
        """Follow the registry's members of `model` that serve requests (registry.SERVING_ROLES:
        never a draft worker) until cancelled (last-known on outages)."""
        from tessera.registry import RegistryUnavailable, serving
        while True:
            try:
                records = serving(await registry.list(model))
                if not records and self.clients:
                    # An empty answer is what a Redis that just restarted gives before the
                    # workers' next heartbeat: keep the known members (dead ones fail fast and
                    # are skipped), never drop from N to 0 on the registry's word alone.
                    log.warning("registry lists no %s workers: keeping %d known", model, len(self.clients))
                else:
                    self.set_members([r.address for r in records])
            except RegistryUnavailable as e:
                log.warning("registry unavailable (%s): keeping %d known workers", e, len(self.clients))
            except Exception:   # never let the watch die: members would stop following the registry
                log.exception("following the registry failed: keeping %d known workers", len(self.clients))
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()


def _cut(address: str, error: WorkerError, state: "_Progress") -> None:
    """The failover as an event of the request's span: the next attempt's route span follows it."""
    tracing.event("failover", **{"tessera.worker.address": address, "error.type": type(error).__name__,
                                 "tessera.generated_tokens": len(state.generated)})


class _Progress:
    """What one request has produced so far across attempts: enough to resume it elsewhere
    (output tokens, text the client received) and to report it as one request."""

    def __init__(self) -> None:
        self.prompt: list[int] | None = None
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generated: list[int] = []
        self.text_sent = 0
        self.compat: str | None = None     # every attempt runs on replicas with this hash
        self.spec = self.spec_before = (0, 0)   # accepted, rejected draft tokens: so far; before this attempt

    def attempt(self, request: GenerateInput, n: int) -> GenerateInput:
        self.spec_before = self.spec       # a worker counts from 0 for each attempt it gets
        if n == 1:
            return request
        rid = f"{request.request_id}-{n}"
        if self.prompt is None:      # nothing came back yet: send the request as it was
            return dataclasses.replace(request, request_id=rid)
        return dataclasses.replace(request, request_id=rid, text=None, messages=None,
                                   token_ids=tuple(self.prompt),
                                   resume=Resume(tuple(self.generated), self.text_sent))

    def seen(self, chunk: GenerateChunk) -> GenerateChunk:
        if self.prompt is None:
            self.prompt, self.prompt_tokens = list(chunk.prompt_token_ids), chunk.prompt_tokens
            self.cached_tokens = chunk.cached_tokens
        elif chunk.prompt_token_ids:     # a resumed attempt's first chunk: the client saw the prompt
            chunk = dataclasses.replace(chunk, prompt_token_ids=())
        if chunk.cached_tokens != self.cached_tokens:
            # usage reports what the first attempt's prefix cache served: a resumed attempt
            # re-reads prompt + output on another worker, and its hit there is not the request's
            chunk = dataclasses.replace(chunk, cached_tokens=self.cached_tokens)
        self.generated.extend(chunk.token_ids)
        self.text_sent += len(chunk.text)
        if self.spec_before != (0, 0):     # a resumed attempt: its worker counted from 0
            accepted, rejected = self.spec_before
            chunk = dataclasses.replace(chunk, accepted_tokens=accepted + chunk.accepted_tokens,
                                        rejected_tokens=rejected + chunk.rejected_tokens)
        self.spec = (chunk.accepted_tokens, chunk.rejected_tokens)
        return chunk
