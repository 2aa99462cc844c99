"""Our forward against transformers on tiny random checkpoints loaded through our loader."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tessera.config import CacheConfig, EngineConfig, SamplingParams
from tessera.engine import Engine
from tessera.kv_cache import KVCacheManager
from tessera.model_runner import ModelRunner
from tessera.models.loader import load_model
from tessera.scheduler import ScheduledRequest, StepPlan

PROMPTS = [[1, 450, 3000, 17, 99, 4093], [2000, 5, 6, 7], [42] * 3 + [31000, 12, 9, 77, 1000, 20000]]


@pytest.mark.parametrize("arch", ["llama", "mixtral", "qwen2_moe", "qwen3_moe", "llama_sharded"])
def test_prefill_logits_match_transformers(tiny_models, arch):
    path = tiny_models[arch]
    model, cfg = load_model(path, torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = ModelRunner(model, num_blocks=16, block_size=4)
    kv = KVCacheManager(16, 4)
    for k, prompt in enumerate(PROMPTS):
        rid = f"r{k}"
        assert kv.allocate(rid, len(prompt))
        # one whole-prompt prefill; its sampled (last-position) logits against HF's
        plan = StepPlan((ScheduledRequest(rid, tuple(prompt), 0, tuple(kv.block_tables[rid]), True),))
        ours = runner.execute(plan)
        with torch.no_grad():
            theirs = ref(torch.tensor([prompt])).logits[0, -1]
        assert torch.allclose(ours[0], theirs, atol=1e-4, rtol=0), (ours[0] - theirs).abs().max()


@pytest.mark.parametrize("arch", ["llama", "mixtral", "qwen2_moe", "qwen3_moe", "llama_sharded"])
def test_greedy_32_tokens_match_transformers(tiny_models, arch):
    path = tiny_models[arch]
    engine = Engine(EngineConfig(model=path, dtype="float32", cache=CacheConfig(block_size=4, num_blocks=64)))
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ours = engine.generate(PROMPTS, greedy)
    for prompt, out in zip(PROMPTS, ours):
        theirs = ref.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out == theirs


# bfloat16: neither we nor transformers can be exact, so each is measured against a float32
# reference on the same checkpoint and ours may be off by at most twice what transformers'
# own bf16 forward is (style rule 6's tolerance, applied to the whole model).
BF16_ARCHS = ["llama", "mixtral", "qwen2_moe", "qwen3_moe"]
EPS = 1e-3    # far below one bf16 ulp of these logits (|logit| ~ 8, ulp 1/16)


def bf16_reference(path: str):
    """(transformers in float32, transformers in bfloat16) on one checkpoint."""
    return tuple(AutoModelForCausalLM.from_pretrained(path, dtype=d).eval() for d in (torch.float32, torch.bfloat16))


@pytest.mark.parametrize("arch", BF16_ARCHS)
def test_bf16_prefill_logits_within_bf16_rounding_of_fp32(tiny_models, arch):
    path = tiny_models[arch]
    model, _ = load_model(path, torch.bfloat16)
    ref, hf_bf16 = bf16_reference(path)
    runner = ModelRunner(model, num_blocks=16, block_size=4)
    kv = KVCacheManager(16, 4)
    for k, prompt in enumerate(PROMPTS):
        rid = f"r{k}"
        assert kv.allocate(rid, len(prompt))
        plan = StepPlan((ScheduledRequest(rid, tuple(prompt), 0, tuple(kv.block_tables[rid]), True),))
        ours = runner.execute(plan)[0].float()
        with torch.no_grad():
            exact = ref(torch.tensor([prompt])).logits[0, -1]
            theirs = hf_bf16(torch.tensor([prompt])).logits[0, -1].float()
        ours_err, hf_err = (ours - exact).abs().max().item(), (theirs - exact).abs().max().item()
        assert ours_err <= 2 * hf_err + EPS, (arch, k, ours_err, hf_err)


@pytest.mark.parametrize("arch", BF16_ARCHS)
def test_bf16_greedy_tokens_are_greedy_up_to_bf16_rounding(tiny_models, arch):
    """Our bf16 greedy tokens need not equal transformers' bf16 ones: wherever the top two fp32
    logits are closer than bf16 rounding, the two (differently fused) forwards may pick either,
    and after one different token the sequences share nothing. So each token we pick is checked
    against the fp32 reference run on our own sequence: if our logits are within 2 * e of it
    (e: transformers' bf16 error at that position), the token we pick has an fp32 logit at most
    4 * e below the best one. This also covers decode from a bf16 KV cache, which prefill does not.
    MoE: where a token's k-th and (k+1)-th fp32 router logits are closer than bf16 rounding,
    either expert set is a correct bf16 choice, and the logits then differ by far more than
    rounding; such positions are skipped (most positions have no tie: asserted)."""
    path = tiny_models[arch]
    engine = Engine(EngineConfig(model=path, dtype="bfloat16", cache=CacheConfig(block_size=4, num_blocks=64)))
    ref, hf_bf16 = bf16_reference(path)
    ours = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    cfg, checked = engine.model_config, 0
    for prompt, out in zip(PROMPTS, ours):
        seq = torch.tensor([prompt + out])
        rows = slice(len(prompt) - 1, -1)   # row i predicts token i + 1: the rows that chose our outputs
        with torch.no_grad():
            fp32 = ref(seq, output_router_logits=True) if cfg.num_experts else ref(seq)
            exact = fp32.logits[0, rows]
            hf_err = (hf_bf16(seq).logits[0, rows].float() - exact).abs().amax(dim=-1)
        chosen = exact.gather(1, torch.tensor(out)[:, None])[:, 0]
        shortfall = exact.amax(dim=-1) - chosen
        tie = _router_tie(fp32, cfg)[rows]
        bad = (shortfall > 4 * hf_err + EPS) & ~tie
        assert not bad.any(), (arch, shortfall[bad].tolist(), hf_err[bad].tolist(), bad.nonzero().tolist())
        checked += int((~tie).sum())
    assert checked >= 0.75 * sum(len(o) for o in ours)


def _router_tie(fp32_out, cfg) -> torch.Tensor:
    """Per position: does some layer's router rank its k-th and (k+1)-th expert within bf16's
    error there? A bf16 forward's logits are off by ~2^-6 of their size after two layers
    (transformers' own, measured by these tests), so a margin under 2^-5 counts as a tie."""
    n = fp32_out.logits.shape[1]
    tie = torch.zeros(n, dtype=torch.bool)
    for logits in getattr(fp32_out, "router_logits", None) or ():
        top = logits.reshape(n, -1).float().topk(cfg.num_experts_per_tok + 1, dim=-1).values
        tie |= (top[:, -2] - top[:, -1]) < top.abs().amax(dim=-1) * 2.0 ** -5
    return tie
