"""SmolLM2-135M from its GGUF: our loader and tokenizer against transformers reading the same file."""
from __future__ import annotations

import pytest
import torch

from tessera.config import SamplingParams
from tessera.models.loader import resolve_model_path

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "Water boils at a temperature of"]


@pytest.fixture(scope="module")
def hf_reference():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = resolve_model_path("smollm2")
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tok


def test_tokenizer_matches_transformers(smollm2_engine, hf_reference):
    _, ref = hf_reference
    ours = smollm2_engine.tokenizer
    for text in PROMPTS + ["Hello 世界 😀 naïve  spaces\n\ttabs", "<|im_start|>user\nhi<|im_end|>"]:
        assert ours(text)["input_ids"] == ref(text)["input_ids"]
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert ours.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == \
        ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)


def test_greedy_matches_transformers(smollm2_engine, hf_reference):
    model, _ = hf_reference
    e = smollm2_engine
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for text in PROMPTS:
        ids = e.tokenizer(text)["input_ids"]
        ours = e.generate([ids], sp)[0]
        with torch.no_grad():
            theirs = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert ours == theirs, text
