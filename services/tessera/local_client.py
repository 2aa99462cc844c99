"""LocalWorkerClient: the in-process twin of GrpcWorkerClient (same WorkerClient interface),
so the gateway and a whole deployment can run inside one test process."""
from __future__ import annotations

from typing import AsyncIterator

from tessera.async_engine import AsyncEngine
from tessera.worker_api import GenerateChunk, GenerateInput, WorkerInfo


class LocalWorkerClient:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def generate(self, request: GenerateInput) -> AsyncIterator[GenerateChunk]:
        async for chunk in self.engine.generate(request):
            yield chunk

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def info(self, timeout_s: float = 5.0) -> WorkerInfo:
        """Answers at once (no network): timeout_s is there for the WorkerClient interface."""
        return self.engine.info()

    async def close(self) -> None:
        return None
