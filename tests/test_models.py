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
