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


@pytest.mark.parametrize("delay_ms,first_step", [(0.0, 1), (5000.0, 3)])
def test_an_idle_engine_waits_max_queue_delay_for_a_batch(tiny_models, delay_ms, first_step):
    """Three requests 150 ms apart: without a queue delay the first is prefilled alone; with
    one, the first step waits until max_num_seqs (3) are waiting and prefills them together
    (long before the 5 s delay runs out), as an offline batch sent at once should be."""
    from tessera.config import SchedulerConfig
    cfg = EngineConfig(model=tiny_models["llama"], dtype="float32", cache=CacheConfig(block_size=4, num_blocks=32),
                       scheduler=SchedulerConfig(max_num_seqs=3, max_queue_delay_ms=delay_ms))
    engine = AsyncEngine(lambda: Engine(cfg))
    steps = []
    execute = engine.engine.runner.execute
    engine.engine.runner.execute = lambda plan: steps.append(len(plan.scheduled)) or execute(plan)
    sampling = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    async def run():
        async def one(i):
            await asyncio.sleep(0.15 * i)
            return await _collect(engine.generate(GenerateInput(f"r{i}", sampling, token_ids=(5, 6, i))))
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(3))), 4.0)
    try:
        outs = asyncio.run(run())
        assert all(sum(len(c.token_ids) for c in chunks) == 2 for chunks in outs)
        assert steps[0] == first_step
    finally:
        engine.shutdown()


def test_max_queue_delay_ends_for_fewer_requests_than_a_batch(tiny_models):
    """One request and room for three: it still runs once the delay has passed."""
    from tessera.config import SchedulerConfig
    cfg = EngineConfig(model=tiny_models["llama"], dtype="float32", cache=CacheConfig(block_size=4, num_blocks=32),
                       scheduler=SchedulerConfig(max_num_seqs=3, max_queue_delay_ms=200.0))
    engine = AsyncEngine(lambda: Engine(cfg))

    async def run():
        request = GenerateInput("r", SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), token_ids=(5, 6))
        return await asyncio.wait_for(asyncio.gather(_collect(engine.generate(request))), 5.0)
    try:
        (chunks,) = asyncio.run(run())
        assert sum(len(c.token_ids) for c in chunks) == 2
    finally:
        engine.shutdown()


async def _collect(stream):
    return [c async for c in stream]
