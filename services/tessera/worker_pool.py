"""WorkerPool: one WorkerClient over several workers of the same model (e.g. the M attention
nodes of an AFD deployment). Each request goes to the worker with the fewest requests in
flight from this gateway; abort follows the request to the worker that has it."""
from __future__ import annotations

from typing import AsyncIterator

from tessera.worker_api import GenerateChunk, GenerateInput, WorkerClient, WorkerError, WorkerInfo


class WorkerPool:
    def __init__(self, clients: list[WorkerClient]) -> None:
        if not clients:
            raise ValueError("a pool needs at least one worker")
        self.clients = list(clients)
        self.outstanding = [0] * len(self.clients)
        self._owner: dict[str, int] = {}

    async def generate(self, request: GenerateInput) -> AsyncIterator[GenerateChunk]:
        i = min(range(len(self.clients)), key=lambda k: self.outstanding[k])
        self.outstanding[i] += 1
        self._owner[request.request_id] = i
        try:
            async for chunk in self.clients[i].generate(request):
                yield chunk
        finally:
            self.outstanding[i] -= 1
            self._owner.pop(request.request_id, None)

    async def abort(self, request_id: str) -> None:
        i = self._owner.get(request_id)
        if i is not None:
            await self.clients[i].abort(request_id)

    async def info(self, timeout_s: float = 5.0) -> WorkerInfo:
        """The first worker that answers (they serve the same model)."""
        error: WorkerError | None = None
        for client in self.clients:
            try:
                return await client.info(timeout_s=timeout_s)
            except WorkerError as e:
                error = e
        raise error

    async def close(self) -> None:
        for client in self.clients:
            await client.close()
