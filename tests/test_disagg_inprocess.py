"""Attention-FFN disaggregation inside one process over the local transport: greedy tokens
(and logits) equal to the monolithic engine on the same weights, for M = 1 attention node,
N in {1, 2} expert nodes and m in {1, 2, 3} micro-batches; every token is dispatched once per
layer to each node that owns one of its experts."""
from __future__ import annotations

import re
import time

import pytest
import torch

from tessera.config import AfdConfig, CacheConfig, EngineConfig, SamplingParams
from tessera.disagg.attention_node import build_attention_engine, drop_ffn_weights
from tessera.disagg.control import LinkRefused, LocalExpertControl
from tessera.disagg.expert_node import ExpertNode
from tessera.disagg.attention_runner import AttentionRunner
from tessera.disagg.expert_shard import (CONTROL_LAYER, ExpertShard, ExpertWorker, expert_owners, keep_ffn_share,
                                         parse_experts)
from tessera.engine import Engine
from tessera.models.loader import load_model, model_id_for
from tessera.tokenizer import load_tokenizer
from tessera.transport.base import COMBINE, DISPATCH, PeerError, Tag
from tessera.transport.local import Fabric

PROMPTS = [[1, 450, 3000, 17, 99, 4093], [2000, 5, 6, 7], [42, 42, 42, 31000, 12, 9, 77, 1000, 20000], [7, 8]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def afd_engine(path: str, tokenizer, nodes: int, micro_batches: int, placement=None):
    """placement[j]: the experts node j holds (None: contiguous ranges)."""
    model, _ = load_model(path, torch.float32)
    fabric = Fabric(slots=max(2, micro_batches))
    attn = fabric.endpoint("attn-0")
    names = [f"expert-{i}" for i in range(nodes)]
    workers = [ExpertWorker(ExpertShard.from_model(model, i, nodes, placement[i] if placement else None),
                            fabric.endpoint(n), ["attn-0"]) for i, n in enumerate(names)]
    cfg = EngineConfig(model=path, dtype="float32", cache=CacheConfig(block_size=4, num_blocks=128))
    engine = Engine(cfg, model, tokenizer, make_runner=lambda m, nb, bs: AttentionRunner(
        m, nb, bs, attn, names, micro_batches, placement=placement))
    return engine, workers


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2")


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "llama"])
@pytest.mark.parametrize("nodes,micro_batches", [(1, 1), (2, 1), (2, 2), (1, 3), (2, 3)])
def test_afd_greedy_equals_monolithic(tiny_models, tokenizer, arch, nodes, micro_batches):
    path = tiny_models[arch]
    mono = Engine(EngineConfig(model=path, dtype="float32", cache=CacheConfig(block_size=4, num_blocks=128)),
                  tokenizer=tokenizer)
    expected = mono.generate(PROMPTS, GREEDY)
    engine, workers = afd_engine(path, tokenizer, nodes, micro_batches)
    try:
        assert engine.generate(PROMPTS, GREEDY) == expected
        runner = engine.runner
        if arch != "llama":
            assert runner.tokens_out == sum(w.tokens_in for w in workers)
    finally:
        engine.runner.stop_experts()
        for w in workers:
            w.join()


def test_afd_logits_close_and_each_token_reaches_its_experts(tiny_models, tokenizer):
    path = tiny_models["mixtral"]
    engine, workers = afd_engine(path, tokenizer, nodes=2, micro_batches=2)
    mono, _ = load_model(path, torch.float32)
    from tessera.model_runner import ModelRunner
    from tessera.scheduler import ScheduledRequest, StepPlan
    plan = StepPlan(tuple(ScheduledRequest(f"r{i}", tuple(p), 0, tuple(range(i * 4, i * 4 + 4)), True)
                          for i, p in enumerate(PROMPTS)))
    try:
        ours = engine.runner.execute(plan)
        ref = ModelRunner(mono, 128, 4).execute(plan)
        assert (ours - ref).abs().max() < 1e-4
        # top-2 routing over 2 nodes: each token goes to 1 or 2 nodes per layer, never 0 or 3
        tokens = sum(len(p) for p in PROMPTS)
        layers = mono.config.num_layers
        assert tokens * layers <= engine.runner.tokens_out <= 2 * tokens * layers
        assert engine.runner.tokens_out == sum(w.tokens_in for w in workers)
    finally:
        engine.runner.stop_experts()
        for w in workers:
            w.join()


@pytest.mark.parametrize("placement", [[(0, 2, 4, 6), (1, 3, 5, 7)], [(7, 1), (0, 2, 3, 4, 5, 6)]])
def test_afd_expert_placement_is_configurable(tiny_models, tokenizer, placement):
    """Experts in any (non-contiguous, uneven, unordered) sets: same greedy tokens, and each
    node receives exactly the tokens routed to the experts it holds."""
    path = tiny_models["mixtral"]
    mono = Engine(EngineConfig(model=path, dtype="float32", cache=CacheConfig(block_size=4, num_blocks=128)),
                  tokenizer=tokenizer)
    expected = mono.generate(PROMPTS, GREEDY)
    engine, workers = afd_engine(path, tokenizer, nodes=2, micro_batches=2, placement=placement)
    try:
        assert [w.shard.experts for w in workers] == placement
        assert engine.generate(PROMPTS, GREEDY) == expected
        assert engine.runner.tokens_out == sum(w.tokens_in for w in workers) > 0
    finally:
        engine.runner.stop_experts()
        for w in workers:
            w.join()


@pytest.mark.parametrize("placement,error", [
    ([(0, 1, 2, 3), (3, 4, 5, 6, 7)], "held by expert nodes 0 and 1"),
    ([(0, 1, 2), (4, 5, 6, 7)], r"no expert node holds experts \[3\]"),
    ([(0, 1, 2, 3), (4, 5, 6, 7, 8)], "model has 8"),
])
def test_bad_expert_placement_is_refused(placement, error):
    with pytest.raises(ValueError, match=error):
        expert_owners(placement, 8)


def test_attention_node_refuses_overlapping_expert_sets(tiny_models):
    """The attention node learns each expert node's set when it connects and refuses a
    placement that sends a token's expert to two nodes (or to none)."""
    path = tiny_models["mixtral"]
    model, _ = load_model(path, torch.float32)
    fabric = Fabric(2)
    nodes = [ExpertNode(f"expert-{i}", ExpertShard.from_model(model, i, 2, experts), fabric.endpoint(f"expert-{i}"),
                        "local", model_id_for(path), i, 2) for i, experts in enumerate([(0, 1, 2, 3, 4), (4, 5, 6, 7)])]
    with pytest.raises(LinkRefused, match="expert 4 is held by expert nodes 0 and 1"):
        build_attention_engine(EngineConfig(model=path, dtype="float32"), AfdConfig(expert_nodes=("e0", "e1")),
                               [LocalExpertControl(n) for n in nodes], transport=fabric.endpoint("attention-0"))


def test_nodes_read_only_the_weights_they_hold(tiny_models, monkeypatch):
    """An expert node reads its experts' tensors and nothing else; an attention node reads no
    FFN expert tensor. The pruned shard equals the one cut from the whole model."""
    from tessera.models import loader
    path = tiny_models["mixtral"]
    whole, cfg = load_model(path, torch.float32)
    read, real = [], loader.iter_checkpoint

    def spy(p):
        for name, get in real(p):
            yield name, lambda name=name, get=get: (read.append(name), get())[1]
    monkeypatch.setattr(loader, "iter_checkpoint", spy)
    pruned, _ = loader.load_model(path, torch.float32, prune=lambda m: keep_ffn_share(m, (5, 1)))
    assert len(read) == cfg.num_layers * 2 * 3 and all(re.search(r"\.experts\.[15]\.", n) for n in read)
    ours, ref = (ExpertShard.from_model(m, 0, 4, (5, 1)) for m in (pruned, whole))
    for a, b in zip(ours.layers, ref.layers):
        a, b = a.experts, b.experts
        assert a.ids == (5, 1) and torch.equal(a.gate_up, b.gate_up) and torch.equal(a.down, b.down)
    read.clear()
    loader.load_model(path, torch.float32, prune=drop_ffn_weights)
    assert read and not any(".experts." in n for n in read)


def test_expert_sets_parse_ids_and_ranges():
    assert parse_experts("0-3,6") == (0, 1, 2, 3, 6)
    assert parse_experts("7,1") == (7, 1)
    for bad in ("", "a", "1,1", "3-x", "-2"):
        with pytest.raises(ValueError):
            parse_experts(bad)


def test_afd_smollm2_dense_split_over_two_expert_nodes(smollm2_engine):
    e = smollm2_engine
    prompts = [e.tokenizer(t)["input_ids"] for t in ("The capital of France is", "def add(a, b):", "Once upon")]
    expected = e.generate(prompts, GREEDY)
    engine, workers = afd_engine("smollm2", e.tokenizer, nodes=2, micro_batches=2)
    try:
        assert engine.generate(prompts, GREEDY) == expected
    finally:
        engine.runner.stop_experts()
        for w in workers:
            w.join()


@pytest.mark.parametrize("bad", ["wrong_shape", "unknown_layer", "stale_step_message"])
def test_expert_rejects_bad_messages_and_keeps_serving(tiny_models, tokenizer, bad):
    path = tiny_models["mixtral"]
    engine, workers = afd_engine(path, tokenizer, nodes=1, micro_batches=2)
    runner, transport = engine.runner, engine.runner.transport
    expected = engine.generate(PROMPTS[:2], GREEDY)
    step = runner.step
    if bad == "stale_step_message":   # data with no control message before it
        transport.send("expert-0", Tag(step - 1, 0, 0, DISPATCH), torch.zeros(3, 64 + 4))
    else:
        transport.send("expert-0", Tag(step, 0, CONTROL_LAYER, DISPATCH), torch.tensor([1.0]))
        layer, width = (0, 17) if bad == "wrong_shape" else (7, 64 + 4)
        transport.send("expert-0", Tag(step, 0, layer, DISPATCH), torch.zeros(3, width))
        with pytest.raises(PeerError, match="layer"):   # an error under the expected tag
            transport.recv("expert-0", Tag(step, 0, 0, COMBINE), timeout_s=10)
    try:
        wait_until(lambda: workers[0].rejected == 1)
        assert engine.generate(PROMPTS[:2], GREEDY) == expected   # still serving
    finally:
        runner.stop_experts()
        workers[0].join()


def wait_until(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)
