"""LocalWorkerClient: the in-process twin of GrpcWorkerClient (same WorkerClient interface),
so the gateway and a whole deployment can run inside one test process."""
from __future__ import annotations

from dataclasses import replace
from typing import AsyncIterator

from tessera.async_engine import AsyncEngine
from tessera.generation_defaults import GenerationDefaults
from tessera.worker_api import GenerateChunk, GenerateInput, Tokenized, TokenizeInput, WorkerInfo


class LocalWorkerClient:
    """generation_defaults: what the worker process would report (--generation-config)."""

    def __init__(self, engine: AsyncEngine, generation_defaults: GenerationDefaults = GenerationDefaults()) -> None:
        self.engine = engine
        self.generation_defaults = generation_defaults

    async def generate(self, request: GenerateInput) -> AsyncIterator[GenerateChunk]:
        async for chunk in self.engine.generate(request):
            yield chunk

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def info(self, timeout_s: float = 5.0) -> WorkerInfo:
        """Answers at once (no network): timeout_s is there for the WorkerClient interface."""
        return replace(self.engine.info(), generation_defaults=self.generation_defaults)

    async def tokenize(self, request: TokenizeInput, timeout_s: float = 30.0) -> Tokenized:
        return self.engine.processor.tokenize(request, self.engine.info().max_model_len)

    async def detokenize(self, token_ids: tuple[int, ...], timeout_s: float = 30.0) -> str:
        return self.engine.processor.detokenize(token_ids)

    async def close(self) -> None:
        return None
