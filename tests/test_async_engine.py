"""AsyncEngine given a builder: the engine is built by the thread that steps it (one thread
starts every OpenMP region of the process, see async_engine.py), and a failed build is the
constructor's error, not a dead loop found later."""
from __future__ import annotations

import asyncio
import threading

import pytest

from tessera.async_engine import AsyncEngine
from tessera.config import CacheConfig, EngineConfig, SamplingParams
from tessera.engine import Engine
from tessera.worker_api import GenerateInput


def test_builder_runs_in_the_loop_thread_and_the_engine_serves(tiny_models):
    cfg = EngineConfig(model=tiny_models["llama"], dtype="float32", cache=CacheConfig(block_size=4, num_blocks=32))
    threads = []

    def build() -> Engine:
        threads.append(threading.current_thread())
        return Engine(cfg)

    engine = AsyncEngine(build)
    try:
        assert threads == [engine._thread]

        async def generate():
            request = GenerateInput("r1", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                                    token_ids=(5, 6, 7))
            return [c async for c in engine.generate(request)]
        chunks = asyncio.run(generate())
        assert sum(len(c.token_ids) for c in chunks) == 5 and chunks[-1].finish_reason == "length"
    finally:
        engine.shutdown()


def test_a_failed_build_raises_in_the_constructor():
    def build() -> Engine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(build)
