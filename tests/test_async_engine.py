"""AsyncEngine given a builder: the engine is built by the thread that steps it (one thread
starts every OpenMP region of the process, see async_engine.py), and a failed build is the
constructor's error, not a dead loop found later."""
from __future__ import annotations

import asyncio
import threading
import time

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
    """Three requests 400 ms apart: without a queue delay the first is prefilled alone; with
    one, the first step waits until max_num_seqs (3) are waiting and prefills them together
    (long before the 5 s delay runs out), as an offline batch sent at once should be."""
    engine, steps = _delayed_engine(tiny_models, delay_ms)

    async def run():
        async def one(i):
            await asyncio.sleep(0.4 * i)
            return await _collect(engine.generate(_request(f"r{i}")))
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(3))), 4.0)
    try:
        outs = asyncio.run(run())
        assert all(sum(len(c.token_ids) for c in chunks) == 2 for chunks in outs)
        assert steps[0][1] == first_step
    finally:
        engine.shutdown()


def _delayed_engine(tiny_models, delay_ms: float, max_num_seqs: int = 3, max_waiting: int = 1024):
    """An AsyncEngine with a queue delay, and (monotonic time, requests) of every step it ran."""
    from tessera.config import SchedulerConfig
    cfg = EngineConfig(model=tiny_models["llama"], dtype="float32", cache=CacheConfig(block_size=4, num_blocks=32),
                       scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_waiting=max_waiting,
                                                 max_queue_delay_ms=delay_ms))
    engine = AsyncEngine(lambda: Engine(cfg))
    steps = []
    execute = engine.engine.runner.execute
    engine.engine.runner.execute = lambda plan: steps.append((time.monotonic(), len(plan.scheduled))) or execute(plan)
    return engine, steps


def _request(rid: str) -> GenerateInput:
    return GenerateInput(rid, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), token_ids=(5, 6))


def test_fewer_requests_than_a_batch_run_once_the_delay_has_passed(tiny_models):
    """One request and room for three: its first step comes after the 300 ms delay, and it ends."""
    engine, steps = _delayed_engine(tiny_models, 300.0)
    try:
        start = time.monotonic()
        chunks = asyncio.run(asyncio.wait_for(_collect(engine.generate(_request("r"))), 5.0))
        assert sum(len(c.token_ids) for c in chunks) == 2
        assert steps[0][0] - start >= 0.25
    finally:
        engine.shutdown()


def test_a_full_batch_is_at_most_max_waiting_requests(tiny_models):
    """max_waiting 2 below max_num_seqs 4: two waiting requests are a full batch, so they do
    not wait out the 5 s delay (only two can ever queue)."""
    engine, _ = _delayed_engine(tiny_models, 5000.0, max_num_seqs=4, max_waiting=2)
    try:
        async def both():
            return await asyncio.gather(*(_collect(engine.generate(_request(f"r{i}"))) for i in range(2)))
        outs = asyncio.run(asyncio.wait_for(both(), 3.0))
        assert [sum(len(c.token_ids) for c in chunks) for chunks in outs] == [2, 2]
    finally:
        engine.shutdown()


def test_shutdown_during_the_wait_runs_no_step(tiny_models):
    engine, steps = _delayed_engine(tiny_models, 5000.0)

    async def start_one():
        stream = engine.generate(_request("r"))
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.2)
        engine.shutdown()
        task.cancel()
    asyncio.run(start_one())
    assert steps == [] and not engine._thread.is_alive()


def test_an_abort_during_the_wait_ends_the_request_and_the_engine_serves_on(tiny_models):
    """The only waiting request goes away: the engine goes back to idle (no step for it), and
    the next two requests fill a batch of two and run at once."""
    engine, steps = _delayed_engine(tiny_models, 5000.0, max_num_seqs=2)

    async def run():
        first = asyncio.ensure_future(_collect(engine.generate(_request("gone"))))
        await asyncio.sleep(0.2)
        first.cancel()
        await asyncio.sleep(0.2)
        assert steps == []
        return await asyncio.wait_for(asyncio.gather(*(_collect(engine.generate(_request(f"r{i}")))
                                                       for i in range(2))), 3.0)
    try:
        outs = asyncio.run(run())
        assert [sum(len(c.token_ids) for c in chunks) for chunks in outs] == [2, 2]
    finally:
        engine.shutdown()


async def _collect(stream):
    return [c async for c in stream]
