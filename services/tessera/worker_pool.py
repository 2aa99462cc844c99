"""WorkerPool: one WorkerClient over several workers of the same model (replicas of a
monolithic worker, or the M attention nodes of an AFD deployment).

Routing: each request goes to the live member with the fewest requests in flight from this
gateway. Failover (as Dynamo's migration): when a worker dies mid-request, the request goes
on on another member with the prompt plus the tokens generated so far, so the client's stream
continues; a worker that is full (Saturated) before the first token is skipped the same way.
If no member is left, the request ends with the error. Membership is static (addresses) or
follows a registry (watch()); during a registry outage the last-known members stay.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import AsyncIterator, Callable

from tessera.worker_api import (GenerateChunk, GenerateInput, Saturated, Unavailable, WorkerClient,
                                WorkerError, WorkerInfo)

log = logging.getLogger("tessera.pool")
DOWN_FOR_S = 5.0    # a member that failed is skipped this long (or until the registry drops it)


class WorkerPool:
    def __init__(self, make_client: Callable[[str], WorkerClient], addresses: list[str] = ()) -> None:
        self.make_client = make_client
        self.clients: dict[str, WorkerClient] = {}
        self.outstanding: dict[str, int] = {}
        self.down_until: dict[str, float] = {}
        self._owner: dict[str, tuple[str, str]] = {}     # request id -> (address, attempt id)
        self.failovers = 0
        self.routed: dict[str, int] = {}                  # attempts sent to each address
        self.set_members(list(addresses))

    def set_members(self, addresses: list[str]) -> None:
        for address in addresses:
            if address not in self.clients:
                self.clients[address] = self.make_client(address)
                self.outstanding[address] = 0
        for address in [a for a in self.clients if a not in addresses and not self.outstanding[a]]:
            del self.clients[address], self.outstanding[address]

    @property
    def members(self) -> list[str]:
        return list(self.clients)

    def _pick(self, exclude: set[str]) -> str | None:
        now = time.monotonic()
        live = [a for a in self.clients if a not in exclude and self.down_until.get(a, 0) <= now]
        return min(live, key=lambda a: self.outstanding[a]) if live else None

    async def generate(self, request: GenerateInput) -> AsyncIterator[GenerateChunk]:
        tried: set[str] = set()
        attempt, prompt, generated, prompt_tokens = request, None, [], 0
        error: WorkerError = Unavailable("no worker is available for this model")
        while (address := self._pick(tried)) is not None:
            tried.add(address)
            self.outstanding[address] += 1
            self.routed[address] = self.routed.get(address, 0) + 1
            self._owner[request.request_id] = (address, attempt.request_id)
            try:
                async for chunk in self.clients[address].generate(attempt):
                    if prompt is None:
                        prompt, prompt_tokens = list(chunk.prompt_token_ids), chunk.prompt_tokens
                    elif attempt is not request:      # a resumed stream: report as one request
                        chunk = dataclasses.replace(chunk, prompt_token_ids=(), prompt_tokens=prompt_tokens,
                                                    completion_tokens=len(generated) + chunk.completion_tokens)
                    generated.extend(chunk.token_ids)
                    yield chunk
                return
            except (Unavailable, Saturated) as e:
                error = e
                if isinstance(e, Saturated) and generated:
                    raise
                self.down_until[address] = time.monotonic() + (DOWN_FOR_S if isinstance(e, Unavailable) else 0.5)
                attempt = self._resume(request, prompt, generated, len(tried))
                if isinstance(e, Unavailable):   # a full queue is back-pressure, not a failover
                    self.failovers += 1
                    log.warning("request %s: %s failed (%s); resuming on another worker", request.request_id,
                                address, e)
            finally:
                self.outstanding[address] -= 1
                self._owner.pop(request.request_id, None)
        raise error

    @staticmethod
    def _resume(request: GenerateInput, prompt: list[int] | None, generated: list[int], n: int) -> GenerateInput:
        if prompt is None:      # nothing came back yet: send the request as it was
            return dataclasses.replace(request, request_id=f"{request.request_id}-{n}")
        sampling = request.sampling
        if sampling.max_tokens is not None:
            sampling = dataclasses.replace(sampling, max_tokens=max(1, sampling.max_tokens - len(generated)))
        return GenerateInput(f"{request.request_id}-{n}", sampling, token_ids=tuple(prompt + generated))

    async def abort(self, request_id: str) -> None:
        owner = self._owner.get(request_id)
        if owner is not None:
            await self.clients[owner[0]].abort(owner[1])

    async def info(self, timeout_s: float = 5.0) -> WorkerInfo:
        """The first member that answers (they serve the same model)."""
        error: WorkerError = Unavailable("no worker is available")
        for client in list(self.clients.values()):
            try:
                return await client.info(timeout_s=timeout_s)
            except WorkerError as e:
                error = e
        raise error

    async def watch(self, registry, model: str, interval_s: float = 1.0) -> None:
        """Follow the registry's members of `model` until cancelled (last-known on outages)."""
        from tessera.registry import RegistryUnavailable
        while True:
            try:
                records = await registry.list(model)
                self.set_members([r.address for r in records])
            except RegistryUnavailable as e:
                log.warning("registry unavailable (%s): keeping %d known workers", e, len(self.clients))
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()
