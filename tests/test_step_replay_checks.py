"""Every replayed step against the eager step, with prefix caching on (the default), after
preemption and with prompt chunks beside decode rows; and the re-check setting
(--replay-check-every, the suite's TESSERA_REPLAY_CHECK_EVERY / _STRICT) that catches a graph
drifting after its first check."""
from __future__ import annotations

import gc
import logging

import pytest

from test_step_graph import _NO_PREFIX_CACHE, _generate, _recordable_sizes, pytestmark  # noqa: F401 (the C kernels' skip)
from tessera import step_graph
from tessera.config import CacheConfig, EngineConfig, SamplingParams
from tessera.engine import Engine


def _workload(engine: Engine) -> tuple[list, dict[str, set]]:
    """Four requests sharing a 40-token prefix, arriving three steps apart, in a KV cache too small
    for all of them (12 blocks of 16): each newcomer's chunk after the shared blocks runs beside
    the others' decode rows, and the newest running requests are preempted and recomputed after
    the blocks their prefix left cached. Returns each request's (token, logprob, top-5) list and,
    for every kind of row, the steps a replay served that held one: "decode", "prompt" (a chunk
    from position 0), "after_cached" (a chunk after blocks the prefix cache holds) and
    "recompute" (a chunk of a request preempted before)."""
    graphs, real = engine.runner.graphs, engine.runner.execute
    kinds: dict[str, set] = {k: set() for k in ("decode", "prompt", "after_cached", "recompute")}
    step = iter(range(10**6))

    def execute(plan):
        before, n = graphs.replayed_steps if graphs else 0, next(step)
        logits = real(plan)
        if graphs and graphs.replayed_steps > before:
            for e in plan.scheduled:
                r = engine.scheduler.requests[e.request_id]
                chunk = e.start_pos < r.num_tokens - 1
                kind = "decode" if not chunk else "recompute" if r.num_preemptions else \
                    "after_cached" if e.start_pos else "prompt"
                kinds[kind].add(n)
        return logits
    engine.runner.execute = execute
    shared = list(range(1000, 1040))
    sampling = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=5)
    out: dict[str, list] = {}
    try:
        for i in range(200):
            if i % 3 == 0 and len(out) < 4:
                out[engine.add_request(shared + list(range(2000 + 10 * i, 2008 + 10 * i)), sampling)] = []
            for o in engine.step():
                out[o.request_id] += [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs]
            if len(out) == 4 and not engine.has_unfinished:
                break
    finally:
        engine.runner.execute = real
    assert engine.kv.stats.hits > 0
    return list(out.values()), kinds


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replayed_steps_equal_eager_ones_with_prefix_caching_preemption_and_mixed_rows(dtype):
    """With prefix caching on (the default), a worker's warmed-up graphs serve steps whose
    prompt chunks start after cached blocks, sit beside decode rows and recompute preempted
    requests: every replayed step, checked against the eager step on the same inputs
    (replay_check_every=1), has its bits; and an engine replaying them unchecked gives the
    eager engine's tokens and logprobs, bit for bit."""
    from tessera.config import SchedulerConfig
    from tessera.entrypoints.worker import _warmed

    def make(**extra) -> Engine:
        cfg = EngineConfig(dtype=dtype, num_threads=2, cache=CacheConfig(num_blocks=12),
                           scheduler=SchedulerConfig(max_num_batched_tokens=64), **extra)
        return _warmed(Engine(cfg))
    checked = make(replay_check_every=1)
    if _recordable_sizes(checked, (1, 2, 3, 32)) != {1, 2, 3, 32}:
        pytest.skip("a linear of these sizes is not a C kernel on this CPU")
    graphs = checked.runner.graphs
    before = graphs.replayed_steps
    _, kinds = _workload(checked)
    assert graphs.mismatches == 0 and not graphs.dropped
    assert all(kinds.values()), kinds            # every kind of row was served by a replay
    assert kinds["decode"] & kinds["after_cached"] and kinds["decode"] & kinds["recompute"], kinds
    assert graphs.replayed_steps - before > 30 and graphs.checked_steps == graphs.replayed_steps
    replayed = make(replay_check_every=0)
    got, kinds = _workload(replayed)
    assert all(kinds.values()) and replayed.runner.graphs.checked_steps == 0, kinds
    assert got == _workload(make(enforce_eager=True))[0]


def test_a_graph_that_drifts_after_its_check_is_caught_by_the_recheck(monkeypatch, caplog):
    """A graph that passed its first check and later replays wrong bits (a value its recording
    baked in): with TESSERA_REPLAY_CHECK_EVERY=1 the next replayed step is checked, the graph is
    counted, logged and dropped, and the tokens stay the eager ones; without re-checks, the
    wrong bits are served."""
    monkeypatch.delenv("TESSERA_REPLAY_CHECK_STRICT", raising=False)   # the serving path, not the suite's
    real = step_graph.StepGraph.replay
    replays = []

    def drifting(self, model, batch, inputs):
        replays.append(self.rows)
        out = real(self, model, batch, inputs)
        return out + 1 if len(replays) > 4 else out
    prompt = list(range(500, 540))
    results = {}
    for every in ("1", "0"):
        monkeypatch.setenv("TESSERA_REPLAY_CHECK_EVERY", every)
        engine = Engine(EngineConfig(dtype="float32", num_threads=2, cache=_NO_PREFIX_CACHE))
        if _recordable_sizes(engine, {1}) != {1}:
            pytest.skip("a float32 linear of one row is not a C kernel on this CPU")
        assert engine.runner.graphs.check_every == int(every)
        replays.clear()
        monkeypatch.setattr(step_graph.StepGraph, "replay", drifting)
        with caplog.at_level(logging.WARNING, logger="tessera.step_graph"):
            results[every] = _generate(engine, False, [prompt], [12]), engine.runner.graphs
        monkeypatch.setattr(step_graph.StepGraph, "replay", real)
    expected = _generate(engine, True, [prompt], [12])
    (checked, graphs), (unchecked, silent) = results["1"], results["0"]
    assert checked == expected and graphs.mismatches == 1 and graphs.dropped == {1} and not graphs.graphs
    assert graphs.checked_steps == graphs.replayed_steps >= 3
    assert "differs from the eager step on a re-check" in caplog.text
    assert unchecked != expected and silent.mismatches == 0 and silent.replayed_steps > 4
    # The suite's strict mode: the re-check's mismatch is an error, not a quiet fallback.
    del engine, results, graphs, silent    # the engines above, before another one is built
    gc.collect()
    monkeypatch.setenv("TESSERA_REPLAY_CHECK_EVERY", "1")
    monkeypatch.setenv("TESSERA_REPLAY_CHECK_STRICT", "1")
    engine = Engine(EngineConfig(dtype="float32", num_threads=2, cache=_NO_PREFIX_CACHE))
    replays.clear()
    monkeypatch.setattr(step_graph.StepGraph, "replay", drifting)
    with pytest.raises(RuntimeError, match="on a re-check"):
        _generate(engine, False, [prompt], [12])
