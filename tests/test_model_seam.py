"""The model seam (models/driver.py and the FFN's prepare/compute/finish/shard): a pipeline
split of the layers, explicit masks and positions, tree verification and FFN shares all give
what the whole model gives, on tiny random checkpoints."""
from __future__ import annotations

import pytest
import torch

from tessera.batch import build_forward_batch
from tessera.disagg.expert_shard import compute_share, split_range
from tessera.model_runner import ModelRunner
from tessera.models.driver import final_hidden, forward, run_layers
from tessera.models.loader import load_model
from tessera.scheduler import ScheduledRequest, StepPlan

BLOCK = 4
PROMPTS = [[1, 450, 3000, 17, 99, 4093, 8, 9, 10], [2000, 5, 6, 7, 11], [42, 42, 42, 31000, 12, 9, 77]]


def blocks(i: int) -> tuple[int, ...]:
    return tuple(range(8 * i, 8 * i + 8))   # 32 slots per request, disjoint


def entry(i: int, tokens, start: int, sample: bool = True) -> ScheduledRequest:
    return ScheduledRequest(f"r{i}", tuple(tokens), start, blocks(i), sample)


def fresh_kv(model):
    return ModelRunner(model, num_blocks=32, block_size=BLOCK).kv_caches


def logits(model, x, batch):
    return model.compute_logits(final_hidden(model, x, batch))


@pytest.fixture(scope="module", params=["llama", "mixtral", "qwen2_moe"])
def model(request, tiny_models):
    return load_model(tiny_models[request.param], torch.float32)[0]


@torch.inference_mode()
def test_pipeline_split_equals_the_whole_model(model):
    """Layers [0, k) then [k, n) (hidden states handed over) equal layers [0, n), over a
    prefill step and a decode step that reads the KV each half wrote."""
    n = len(model.layers)
    steps = [StepPlan(tuple(entry(i, p, 0) for i, p in enumerate(PROMPTS))),
             StepPlan(tuple(entry(i, [p[-1]], len(p)) for i, p in enumerate(PROMPTS)))]
    whole_kv, split_kv = fresh_kv(model), fresh_kv(model)
    for plan in steps:
        batch = build_forward_batch(plan, BLOCK)
        x = model.embed_tokens(batch.input_ids)
        whole = run_layers(model, x, batch, whole_kv)
        for k in range(1, n):
            half = run_layers(model, x, batch, split_kv, range(0, k))
            split = run_layers(model, half, batch, split_kv, range(k, n))
            assert torch.equal(logits(model, split, batch), logits(model, whole, batch))


def causal(start: int, n: int) -> torch.Tensor:
    return torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]


@torch.inference_mode()
def test_explicit_causal_masks_and_positions_equal_the_implicit_ones(model):
    """A step with a fresh prefill, a prefill chunk over cached context and a decode token:
    passing each chunk's causal mask and the batch's positions explicitly changes nothing
    beyond float32 rounding (implicit causal tokens may run in the paged kernel, explicitly
    masked chunks run in SDPA: the same sums in another order)."""
    kv = fresh_kv(model)
    forward(model, build_forward_batch(StepPlan((entry(0, PROMPTS[0][:5], 0), entry(2, PROMPTS[2], 0))), BLOCK), kv)
    plan = StepPlan((entry(0, PROMPTS[0][5:], 5), entry(1, PROMPTS[1], 0), entry(2, [7], len(PROMPTS[2]))))
    batch = build_forward_batch(plan, BLOCK)
    masks = [causal(c.start_pos, c.num_tokens) for c in batch.prefills]
    implicit = forward(model, batch, [(k.clone(), v.clone()) for k, v in kv])
    explicit = forward(model, batch, kv, positions=batch.positions.clone(), masks=masks)
    assert len(batch.prefills) == 2 and batch.decode_token_idx.numel() == 1
    torch.testing.assert_close(explicit, implicit, rtol=0, atol=1e-5)


@torch.inference_mode()
def test_tree_verification_equals_each_branch_run_alone(model):
    """Draft tree a -> {b, c} after a context: one chunk with positions [p, p+1, p+1] and an
    ancestor mask gives, at b and at c, the logits of the linear sequences context+a+b and
    context+a+c."""
    context, (a, b, c) = PROMPTS[0], (500, 600, 700)
    p = len(context)
    kv = fresh_kv(model)
    forward(model, build_forward_batch(StepPlan((entry(0, context, 0),)), BLOCK), kv)
    batch = build_forward_batch(StepPlan((entry(0, [a, b, c], p),)), BLOCK)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(3, p, dtype=torch.bool), tree], dim=1)
    positions = torch.tensor([p, p + 1, p + 1])
    x = run_layers(model, model.embed_tokens(batch.input_ids), batch, kv, positions=positions, masks=[mask])
    ours = model.compute_logits(model.norm(x))
    for row, branch in ((1, b), (2, c)):
        linear = build_forward_batch(StepPlan((entry(1, [*context, a, branch], 0),)), BLOCK)
        theirs = model.compute_logits(forward(model, linear, fresh_kv(model)))[0]
        torch.testing.assert_close(ours[row], theirs, rtol=0, atol=1e-4)
        assert ours[row].argmax() == theirs.argmax()


@torch.inference_mode()
@pytest.mark.parametrize("count", [1, 3])
def test_ffn_shares_sum_to_the_whole_ffn_and_leave_it_whole(model, count):
    """Each layer's FFN cut into `count` compute shares (expert sets or column ranges): the
    partial outputs add up to the whole compute, and the model's own FFN is untouched."""
    cfg = model.config
    h = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    for layer in model.layers:
        ffn = layer.ffn
        ffn_in = ffn.prepare(h)
        whole = ffn.compute(ffn_in)
        shares = [compute_share(ffn, tuple(range(*split_range(cfg.num_experts, count, i))) or None,
                                split_range(cfg.intermediate_size, count, i)) for i in range(count)]
        total = sum(share.compute(ffn_in) for share in shares)
        torch.testing.assert_close(total, whole, rtol=0, atol=1e-5)
        assert torch.equal(ffn.compute(ffn.prepare(h)), whole)
