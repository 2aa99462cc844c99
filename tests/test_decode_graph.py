"""Replayed decode steps (tessera_kernels.replay, tessera.decode_graph) against the eager engine."""
from __future__ import annotations

import logging
import threading

import pytest
import torch

from tessera import decode_graph
from tessera.config import CacheConfig, EngineConfig, SamplingParams
from tessera.engine import Engine
from tessera_kernels import elementwise_cpu, replay

pytestmark = pytest.mark.skipif(elementwise_cpu._library(torch.float32) is None, reason="no C compiler for the kernels")


def test_a_recording_makes_its_calls_again_on_the_buffers_new_values():
    a, b, w = torch.randn(2, 32), torch.randn(2, 32), torch.rand(32) + 0.5
    with replay.record() as rec:
        y = elementwise_cpu.rms_norm(elementwise_cpu.add(a, b), w, 1e-6)
    assert rec.refused is None and len(rec.calls) == 2 and len(rec.tensors) == 2   # the sum's buffer and y
    a.copy_(torch.randn(2, 32))
    rec.replay()
    assert torch.equal(y, elementwise_cpu.rms_norm(elementwise_cpu.add(a, b), w, 1e-6))


def test_a_recording_refuses_torch_ops_that_compute_and_ignores_other_threads():
    a = torch.randn(4, 16)
    other = threading.Thread(target=lambda: elementwise_cpu.add(a, a))
    with replay.record() as rec:
        other.start()
        other.join()
        b = a.view(2, 32)[:, :16]          # views and allocations are fine
        elementwise_cpu.add(a, a)
        assert rec.refused is None
        b * 2
    assert rec.refused == "aten.mul.Tensor" and len(rec.calls) == 1
    with pytest.raises(RuntimeError, match="aten.mul"):
        rec.replay()


def _generate(engine: Engine, eager: bool, prompts, max_tokens) -> list[list[int]]:
    """Greedy tokens of prompts started together and finishing after their own max_tokens (the
    batch shrinks step by step), with the engine's graphs or without."""
    graphs = engine.runner.graphs
    engine.runner.graphs = None if eager else graphs
    try:
        ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
               for p, m in zip(prompts, max_tokens)]
        out: dict[str, list[int]] = {i: [] for i in ids}
        while engine.has_unfinished:
            for o in engine.step():
                out[o.request_id].extend(o.new_token_ids)
        return [out[i] for i in ids]
    finally:
        engine.runner.graphs = graphs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replayed_steps_give_the_eager_engines_tokens(dtype):
    """SmolLM2's real weights: one request, then five that finish at different steps (batch
    sizes 5, 4, ..., 1 each recorded, checked and replayed), and a batch over max_batch (eager)."""
    engine = Engine(EngineConfig(dtype=dtype, num_threads=2, cache=CacheConfig(enable_prefix_caching=False)))
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.max_batch == decode_graph.MAX_BATCH
    graphs.max_batch = 5
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (37, 5, 130, 64, 16)]
    cases = [([prompts[0]], [24]), (prompts, [30, 12, 20, 16, 24]),
             ([prompts[1]] * 6, [4] * 6)]
    for case in cases:
        assert _generate(engine, False, *case) == _generate(engine, True, *case)
    assert set(graphs.graphs) == {1, 2, 3, 4, 5} and all(gr.verified for gr in graphs.graphs.values())
    assert graphs.replayed_steps > 30 and 6 not in graphs.attempts
    # one pool for the five graphs, as large as the largest needs (1 then 5 requests: grown twice)
    assert graphs.pool.buffer.numel() == graphs.pool.needed > 0


def test_a_step_with_torch_ops_is_not_recorded_and_stays_exact(tiny_models):
    """An MoE router runs torch ops: its decode steps stay eager, tokens unchanged."""
    engine = Engine(EngineConfig(model=tiny_models["mixtral"], dtype="float32", num_threads=2))
    prompts, lens = [[5, 6, 7, 8], [9, 10, 11]], [10, 6]
    assert _generate(engine, False, prompts, lens) == _generate(engine, True, prompts, lens)
    graphs = engine.runner.graphs
    assert not graphs.graphs and graphs.replayed_steps == 0 and graphs.attempts == {2: 2, 1: 2}


def test_a_replay_that_differs_from_the_eager_step_is_dropped(monkeypatch, caplog):
    engine = Engine(EngineConfig(dtype="float32", num_threads=2, cache=CacheConfig(enable_prefix_caching=False)))
    real = decode_graph.DecodeGraph.replay

    def corrupted(self, model, batch):
        return real(self, model, batch) + 1     # as a call the recording missed would leave it
    monkeypatch.setattr(decode_graph.DecodeGraph, "replay", corrupted)
    prompt = list(range(200, 240))
    with caplog.at_level(logging.WARNING, logger="tessera.decode_graph"):
        got = _generate(engine, False, [prompt], [12])
    assert got == _generate(engine, True, [prompt], [12])
    assert not engine.runner.graphs.graphs and engine.runner.graphs.replayed_steps == 0
    assert "differs from the eager step" in caplog.text


def test_enforce_eager_makes_no_graphs():
    engine = Engine(EngineConfig(dtype="float32", num_threads=2, enforce_eager=True))
    assert engine.runner.graphs is None
