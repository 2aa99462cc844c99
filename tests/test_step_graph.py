"""Replayed steps (tessera_kernels.replay, tessera.step_graph) against the eager engine: a test
that expects replays fails when it got none (_replays); these compare whole runs with prefix
caching off (test_step_replay_checks.py: every replayed step, with it on)."""
from __future__ import annotations

import contextlib
import ctypes
import logging
import threading

import pytest
import torch

from tessera import step_graph
from tessera.config import CacheConfig, EngineConfig, SamplingParams
from tessera.engine import Engine
from tessera.layers import linear, quant
from tessera_kernels import elementwise_cpu, gemv_cpu, gemv_quant_cpu, replay

pytestmark = pytest.mark.skipif(elementwise_cpu._library(torch.float32) is None, reason="no C compiler for the kernels")
# Both runs of a prompt prefill it whole: a prefix-cache hit would prefill the rest in other
# tiles, whose last bits may differ (layers/attention.py), and bf16 tokens with them.
_NO_PREFIX_CACHE = CacheConfig(enable_prefix_caching=False)


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
    with torch.inference_mode(), replay.record() as rec:   # as the engine records: `to` stays one op
        other.start()
        other.join()
        b = a.view(2, 32)[:, :16].to(torch.float32)   # views, allocations, a `to` that is a no-op
        elementwise_cpu.add(a, a)
        assert rec.refused is None
        b.to(torch.bfloat16)               # a `to` whose schema may alias, but that copies
    assert rec.refused == "aten.to.dtype" and len(rec.calls) == 1
    with pytest.raises(RuntimeError, match="aten.to"):
        rec.replay()
    with torch.inference_mode(), replay.record() as rec:
        torch.tensor([1.0, 2.0])           # data filled from Python: not a view of anything
    assert rec.refused == "aten.lift_fresh.default"


def test_work_paused_inside_a_recording_is_neither_refused_nor_recorded():
    a, pool = torch.randn(4, 16), replay.Pool()
    pool.used = 1 << 16
    pool.grow()
    with torch.inference_mode(), replay.record(pool) as rec:
        with replay.paused():
            packed = (a * 2).contiguous()          # computes: outside a pause it would be refused
            elementwise_cpu.add(a, a)              # a kernel call made once, not part of the step
        y = elementwise_cpu.add(a, packed)
    assert rec.refused is None and len(rec.calls) == 1
    assert y.untyped_storage().data_ptr() == pool.buffer.data_ptr()      # the step's buffer: the pool's
    assert packed.untyped_storage().data_ptr() != pool.buffer.data_ptr()  # the paused work's: its own
    a.copy_(torch.randn(4, 16))
    rec.replay()
    assert torch.equal(y, a + packed)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_first_step_that_packs_the_weights_is_recorded_and_replayed(dtype):
    """A linear packs its weight for the register or AMX tiles on its first product of 5+
    rows; the fresh engine's first such step packs them while it is recorded, is kept (it was
    refused for it and ran eagerly before), is checked, and then replays with the eager
    engine's tokens."""
    engine = Engine(EngineConfig(dtype=dtype, num_threads=2, cache=_NO_PREFIX_CACHE))
    graphs, lin = engine.runner.graphs, engine.runner.model.layers[0].attn.qkv_proj
    x = torch.zeros(8, lin.weight.shape[1], dtype=lin.weight.dtype)
    packed_kernel = any(k.applies(x, lin.weight) for k in linear._PACKED_KERNELS)
    if 8 not in _recordable_sizes(engine, (8,)) or not packed_kernel:
        pytest.skip("no packed-weight kernel takes 8 rows on this CPU")
    graphs.pool.used = 64 << 20          # room for the step: the first recording is kept, not grown out
    graphs.pool.grow()
    assert lin._packed is None
    g = torch.Generator().manual_seed(8)
    first, second = (torch.randint(100, 40000, (8,), generator=g).tolist() for _ in range(2))
    _generate(engine, False, [first], [2])
    assert lin._packed is not None and 8 in graphs.graphs and 8 not in graphs.refusals
    assert _generate(engine, False, [second], [2]) == _generate(engine, True, [second], [2])
    assert graphs.graphs[8].verified and not graphs.dropped
    third = torch.randint(100, 40000, (8,), generator=g).tolist()
    with _replays(graphs, 2):      # the prompt's step (8 rows) and its decode step
        assert _generate(engine, False, [third], [2]) == _generate(engine, True, [third], [2])


@contextlib.contextmanager
def _replays(graphs: step_graph.StepGraphs, expected: int | None = None):
    """The steps run inside must include replays served by checked graphs: exactly `expected`
    of them, or at least one (a test of replays that replays nothing passes for nothing)."""
    before = graphs.replayed_steps
    yield
    got = graphs.replayed_steps - before
    assert got == expected if expected is not None else got > 0, f"{got} replayed steps"


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


def _recordable_sizes(engine: Engine, sizes) -> set[int]:
    """The batch sizes at which the decoder layers' linears take a C kernel on this CPU (the
    GEMV, the AMX or register tiles, the int4/int8 GEMVs in bf16); at others a linear goes to
    oneDNN or converts its input, and the step is not recorded."""
    lin = engine.runner.model.layers[0].attn.qkv_proj
    dtype = engine.runner.model.embed_tokens.weight.dtype
    if isinstance(lin, (quant.Int4Linear, quant.Int8Linear)):
        rows = quant.GEMV_MAX_ROWS if isinstance(lin, quant.Int4Linear) else quant.GEMV_MAX_ROWS_INT8
        ok = dtype == torch.bfloat16 and gemv_quant_cpu.available()
        return {b for b in sizes if ok and b <= rows}
    w = lin.weight
    return {b for b in sizes
            if (x := torch.zeros(b, w.shape[1], dtype=w.dtype)) is not None
            and (gemv_cpu.applies(x, w) or any(k.applies(x, w) for k in linear._PACKED_KERNELS))}


@pytest.mark.parametrize("dtype,quantization", [("float32", None), ("bfloat16", None), ("bfloat16", "int4"),
                                                ("float32", "int4")])
def test_replayed_steps_give_the_eager_engines_tokens(dtype, quantization):
    """SmolLM2's real weights: one request, then five that finish at different steps (batch
    sizes 5, 4, ..., 1 each recorded, checked and replayed, the pool grown once on the way), and a
    batch over max_batch (eager). int4: its GEMV (up to 16 rows) is recorded as well in bf16;
    in float32 each int4 linear converts its input to bf16 (a torch op): no graphs."""
    engine = Engine(EngineConfig(dtype=dtype, quantization=quantization, num_threads=2, cache=_NO_PREFIX_CACHE))
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.max_tokens == min(step_graph.MAX_TOKENS, engine.config.scheduler.max_num_batched_tokens)
    graphs.max_tokens = 5
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (37, 5, 130, 64, 16)]
    cases = [([prompts[0]], [24]), (prompts, [30, 12, 20, 16, 24]), ([prompts[1]] * 6, [4] * 6)]
    for case in cases:
        assert _generate(engine, False, *case) == _generate(engine, True, *case)
    expected = _recordable_sizes(engine, range(1, 6))
    assert set(graphs.graphs) == expected and all(gr.verified for gr in graphs.graphs.values())
    if replay._executor() is not None:   # replayed by the C loop: every kernel's signature fits it
        assert all(gr.recording._plan is not None for gr in graphs.graphs.values())
    assert 6 not in graphs.refusals and not graphs.dropped
    # replays wherever there are graphs (more than 30 with batch 1's), none where there are none
    assert graphs.replayed_steps > (30 if 1 in expected else 0) if expected else graphs.replayed_steps == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompt_steps_are_recorded_and_replayed_like_decode_steps(dtype):
    """A prompt alone in its step is T rows like T decode tokens: prompts of 37 tokens, one after
    another, are recorded (after a first try that grows the pool; padded to 48 rows), checked
    and then replayed, with the eager engine's tokens; so is a step where a prompt joins a
    running request (one decode row and 20 prompt rows, padded to 32)."""
    engine = Engine(EngineConfig(dtype=dtype, num_threads=2, cache=_NO_PREFIX_CACHE))
    graphs = engine.runner.graphs
    assert (graphs.rows(1), graphs.rows(16), graphs.rows(21), graphs.rows(37), graphs.rows(48)) == (1, 16, 32, 48, 48)
    if _recordable_sizes(engine, (1, 32, 48)) != {1, 32, 48}:
        pytest.skip("a linear of these sizes is not a C kernel on this CPU")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 40000, (37,), generator=g).tolist() for _ in range(5)]
    for p in prompts[:4]:
        assert _generate(engine, False, [p], [3]) == _generate(engine, True, [p], [3])
    assert graphs.graphs[48].verified and not graphs.dropped
    before = graphs.replayed_steps
    assert _generate(engine, False, [prompts[4]], [3]) == _generate(engine, True, [prompts[4]], [3])
    assert graphs.replayed_steps == before + 3          # the prompt's step and two decode steps

    def joined(eager: bool) -> list[list[int]]:
        kept = graphs
        engine.runner.graphs = None if eager else kept
        try:
            sampling = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
            first = engine.add_request(prompts[0][:9], sampling)
            out = {first: []}
            for step in range(8):
                if step == 2:
                    out[engine.add_request(prompts[1][:20], sampling)] = []
                for o in engine.step():
                    out[o.request_id].extend(o.new_token_ids)
            while engine.has_unfinished:
                for o in engine.step():
                    out[o.request_id].extend(o.new_token_ids)
            return list(out.values())
        finally:
            engine.runner.graphs = kept
    with _replays(graphs):
        assert joined(False) == joined(False) == joined(False) == joined(True)
    assert graphs.graphs[32].verified and not graphs.dropped


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompts_of_other_lengths_share_one_padded_graph_with_the_eager_bits(dtype):
    """Prompts of 33 to 48 tokens replay one graph of 48 rows, the rows after theirs padding.
    Each length's replay is checked against its eager step bit for bit (the graph's check made
    to run again before each); then a length replayed unchecked writes the same K/V as the eager
    engine, and the padding rows write nothing (the caches are equal everywhere)."""
    # unchecked replays (whatever the suite's replay_check_every): their own K/V writes stay
    engine = Engine(EngineConfig(dtype=dtype, num_threads=2, cache=_NO_PREFIX_CACHE, replay_check_every=0))
    eager = Engine(EngineConfig(dtype=dtype, num_threads=2, cache=_NO_PREFIX_CACHE, enforce_eager=True))
    graphs = engine.runner.graphs
    if _recordable_sizes(engine, (1, 48)) != {1, 48}:
        pytest.skip("a linear of these sizes is not a C kernel on this CPU")
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (33, 40, 47, 48, 34, 45)]
    for p in prompts[:-1]:
        if 48 in graphs.graphs:
            graphs.graphs[48].verified = False
        assert _generate(engine, False, [p], [3]) == _generate(engine, True, [p], [3])
        _generate(eager, True, [p], [3])
        _generate(eager, True, [p], [3])
    assert [R for R in graphs.graphs if R > 1] == [48] and graphs.graphs[48].verified and not graphs.dropped
    before = graphs.replayed_steps
    assert _generate(engine, False, [prompts[-1]], [3]) == _generate(eager, True, [prompts[-1]], [3])
    assert graphs.replayed_steps == before + 3
    for (k, v), (k_eager, v_eager) in zip(engine.runner.kv_caches, eager.runner.kv_caches):
        assert torch.equal(k, k_eager) and torch.equal(v, v_eager)


def test_the_workers_warm_up_records_and_checks_every_graph_size_in_its_budget():
    """`tessera worker`'s warm-up: with steps of at most 64 tokens the graph sizes are 32, 48,
    64 and 1-16, each recorded and checked before the worker says ready, and the warm-up's
    prompts leave no KV block in use and nothing in the prefix cache; with a budget of 0 s only
    the sizes its other requests took are recorded (and none of them checked). The shipped 5 s
    budget is not asserted on: how many sizes fit in it depends on how busy the machine is."""
    from tessera.config import SchedulerConfig
    from tessera.entrypoints.worker import _warmed
    small = SchedulerConfig(max_num_batched_tokens=64)
    # a budget no loaded machine runs out of: what is checked here is what the warm-up covers
    engine = _warmed(Engine(EngineConfig(dtype="bfloat16", num_threads=2, scheduler=small, graph_warmup_s=600)))
    graphs = engine.runner.graphs
    assert graphs.row_counts() == [32, 48, 64] + list(range(1, 17))
    # each size recorded at its own length, checked at the shortest that pads to it
    assert [graphs.shortest(R) for R in (32, 48, 64, 7)] == [17, 33, 49, 7]
    if _recordable_sizes(engine, graphs.row_counts()) != set(graphs.row_counts()):
        pytest.skip("a linear of these sizes is not a C kernel on this CPU")
    assert sorted(graphs.graphs) == sorted(graphs.row_counts()) and not graphs.dropped
    assert all(g.verified for g in graphs.graphs.values())
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and not engine.has_unfinished
    engine.step()      # the prefix cache's reset is made at the next step
    assert not any(engine.kv.allocator.cached(b) for b in range(engine.kv.num_blocks)) and engine.kv.stats.queries == 0
    unwarmed = _warmed(Engine(EngineConfig(dtype="bfloat16", num_threads=2, scheduler=small, graph_warmup_s=0)))
    assert not any(g.verified for g in unwarmed.runner.graphs.graphs.values())
    assert set(unwarmed.runner.graphs.graphs) < set(graphs.graphs)


def test_padding_starts_above_every_row_count_where_a_linear_changes_kernel():
    """A step of T > PAD_FROM tokens runs its linears on rows(T) rows: both counts must take the
    same kernel (the GEMVs, dense and quantized, stop at or below PAD_FROM rows; the tiles start
    at or below it), or the padded rows' bits could differ from the eager step's."""
    from tessera_kernels import amx_linear, tile_linear
    below = (gemv_cpu.MAX_ROWS, amx_linear.MIN_ROWS, tile_linear.BF16_MIN_ROWS, quant.GEMV_MAX_ROWS,
             quant.GEMV_MAX_ROWS_INT8)
    assert max(below) <= step_graph.PAD_FROM < step_graph.MAX_TOKENS
    graphs = step_graph.StepGraphs.__new__(step_graph.StepGraphs)
    graphs.max_tokens = 100          # a token budget that is not a multiple of PAD_TO
    assert [graphs.rows(T) for T in (1, 16, 17, 32, 33, 96, 97, 100)] == [1, 16, 32, 32, 48, 96, 100, 100]


def test_the_first_overflow_sizes_the_pool_for_the_largest_step():
    """Sizes 1, 2, 1, 3, 1 (each a prompt of 4 tokens a request, then decode steps), then a
    prompt of max_tokens: the first recording overflows the empty pool, which grows to what a
    step of max_tokens takes (the first step's bytes per token times max_tokens), so no later
    step grows it or drops a graph: size 1's graph is recorded once and serves to the end."""
    engine = Engine(EngineConfig(dtype="bfloat16", num_threads=2))
    graphs = engine.runner.graphs
    sizes = (1, 2, 3, 4, 8, 12, graphs.max_tokens)
    if _recordable_sizes(engine, sizes) != set(sizes):
        pytest.skip("a linear of these sizes is not a C kernel on this CPU")
    _generate(engine, False, [[100, 7, 8, 9]], [6])
    one, size = graphs.graphs[1], graphs.pool.buffer.numel()
    with _replays(graphs):
        for n in (2, 1, 3, 1):
            _generate(engine, False, [[100 + i, 7, 8, 9] for i in range(n)], [6] * n)
    _generate(engine, False, [list(range(100, 100 + graphs.max_tokens))], [2])   # the largest step
    assert graphs.graphs[1] is one and one.verified and not graphs.dropped
    assert graphs.pool.buffer.numel() == size >= graphs.pool.used
    # each larger size recorded (or refused once, which grows nothing)
    assert all(T in graphs.graphs or graphs.refusals.get(T) == 1 for T in (8, 12, graphs.max_tokens))


def test_a_step_with_torch_ops_is_not_recorded_and_stays_exact(tiny_models):
    """An MoE router runs torch ops: its decode steps stay eager, tokens unchanged."""
    engine = Engine(EngineConfig(model=tiny_models["mixtral"], dtype="float32", num_threads=2))
    prompts, lens = [[5, 6, 7, 8], [9, 10, 11]], [10, 6]
    assert _generate(engine, False, prompts, lens) == _generate(engine, True, prompts, lens)
    graphs = engine.runner.graphs
    assert not graphs.graphs and graphs.replayed_steps == 0 and graphs.refusals == {7: 1, 2: 2, 1: 2}
    assert not graphs.dropped          # refused while recording, not dropped after a failed check
    # a fourth size refused (a prompt of 3 tokens), none kept: no step of this model is recorded again
    _generate(engine, False, [[5, 6, 7]], [2])
    _generate(engine, False, [[5, 6, 7, 8, 9]], [2])
    assert graphs.refusals == {7: 1, 3: 1, 2: 2, 1: 2} and len(graphs.refusals) == step_graph.REFUSED_SIZES


def test_a_replay_that_differs_from_the_eager_step_is_dropped_and_its_kv_overwritten(monkeypatch, caplog):
    """A replay that computes wrong K/V and hidden states (as a call the recording missed
    would): the eager step runs after it, so its K/V stay and the tokens are the eager ones."""
    engine = Engine(EngineConfig(dtype="float32", num_threads=2, cache=_NO_PREFIX_CACHE))
    if _recordable_sizes(engine, {1}) != {1}:
        pytest.skip("a float32 linear of one row is not a C kernel on this CPU")
    real = step_graph.StepGraph.replay

    def corrupted(self, model, batch, inputs):
        out = real(self, model, batch, inputs)
        for k, v in engine.runner.kv_caches:
            k[:, batch.slot_mapping] += 1.0
        return out + 1
    monkeypatch.setattr(step_graph.StepGraph, "replay", corrupted)
    prompt = list(range(200, 240))
    with caplog.at_level(logging.WARNING, logger="tessera.step_graph"):
        got = _generate(engine, False, [prompt], [12])
    assert got == _generate(engine, True, [prompt], [12])
    graphs = engine.runner.graphs
    assert not graphs.graphs and graphs.replayed_steps == 0 and graphs.dropped == {1}
    assert "differs from the eager step" in caplog.text


@pytest.mark.parametrize("in_python", [False, True], ids=["c-loop", "python-loop"])
def test_a_replay_that_fails_midway_is_dropped_and_the_step_run_eagerly(monkeypatch, caplog, in_python):
    if in_python:
        monkeypatch.setattr(replay, "_executor", lambda: None)
    elif replay._executor() is None:
        pytest.skip("no C replay loop here (not x86-64 Linux, or it did not build)")
    engine = Engine(EngineConfig(dtype="float32", num_threads=2, cache=_NO_PREFIX_CACHE))
    if _recordable_sizes(engine, {1}) != {1}:
        pytest.skip("a float32 linear of one row is not a C kernel on this CPU")
    real, replays = replay.Recording.replay, []

    def failing(self):
        replays.append(self)
        if len(replays) == 3:   # a kernel's int status other than when recorded, past the first call
            assert (self._plan is None) == in_python
            i = next(i for i, (fn, _, result) in enumerate(self.calls) if fn.restype is ctypes.c_int and i > 0)
            fn, args, result = self.calls[i]
            self.calls[i] = (fn, args, result + 1)
            if self._plan is not None:          # the C loop's record of the same call
                self._plan[i].expect = result + 1
        return real(self)
    monkeypatch.setattr(replay.Recording, "replay", failing)
    prompt = list(range(300, 340))
    with caplog.at_level(logging.WARNING, logger="tessera.step_graph"):
        got = _generate(engine, False, [prompt], [12])
    assert got == _generate(engine, True, [prompt], [12])
    assert len(replays) == 3 and not engine.runner.graphs.graphs and engine.runner.graphs.dropped == {1}
    assert "failed" in caplog.text


def test_enforce_eager_makes_no_graphs():
    engine = Engine(EngineConfig(dtype="float32", num_threads=2, enforce_eager=True))
    assert engine.runner.graphs is None


def test_the_c_loop_passes_integers_and_floats_and_checks_int_results():
    """replay_calls.c's one prototype for every kernel: integer-class arguments in order, floats
    in order (libm's lrintf takes its float in xmm0), int results compared with the recorded
    ones; a function with another signature (a double) leaves the recording in Python."""
    if replay._executor() is None:
        pytest.skip("no C replay loop here (not x86-64 Linux, or it did not build)")
    libc, libm = ctypes.CDLL(None), ctypes.CDLL("libm.so.6")
    labs, lrintf, fabs = libc.labs, libm.lrintf, libm.fabs
    labs.argtypes, labs.restype = [ctypes.c_int64], ctypes.c_int
    lrintf.argtypes, lrintf.restype = [ctypes.c_float], ctypes.c_int
    fabs.argtypes, fabs.restype = [ctypes.c_double], None
    rec = replay.Recording()
    rec.calls += [(labs, (-5,), 5), (lrintf, (2.75,), 3)]
    rec.replay()
    assert rec._plan is not None and len(rec._plan) == 2
    rec.calls[1] = (lrintf, (2.75,), 4)
    rec._planned = False
    with pytest.raises(RuntimeError, match="lrintf returned 3 on replay, 4 when recorded"):
        rec.replay()
    other = replay.Recording()
    other.calls += [(labs, (-5,), 5), (fabs, (-1.5,), None)]
    other.replay()
    assert other._plan is None


# -- prefix caching on (the default), preemption, prompt chunks beside decode rows ----------------
