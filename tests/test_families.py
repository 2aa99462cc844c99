"""The model families users bring, each against transformers on a tiny random checkpoint that
transformers itself builds and saves (save_pretrained, SmolLM2's tokenizer beside it), loaded
by our loader: greedy tokens identical in float32 on a prompt longer than the context tricks
(rope scaling's original length, a sliding window), bfloat16 within test_models' rule; every
family monolithic = speculative = pipeline shards (and AFD for the FFNs that differ); refused
checkpoints exit 78 once."""
from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from tessera.config import CacheConfig, EngineConfig, SamplingParams, SchedulerConfig, SpeculativeConfig
from tessera.engine import Engine
from tessera.models.default_model import default_tokenizer
import test_models
from test_models import EPS, bf16_reference

_BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)

# family -> (transformers config class, its arguments). Small original lengths and windows so
# that a 100-token prompt is far past them.
FAMILIES = {
    "llama3_rope": ("LlamaConfig", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    "linear_rope": ("LlamaConfig", dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0))),
    "yarn_rope": ("LlamaConfig", dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64))),
    # dynamic NTK: the original length is max_position_embeddings (we serve factor times it)
    "dynamic_rope": ("LlamaConfig", dict(max_position_embeddings=32, rope_parameters=dict(
        rope_type="dynamic", rope_theta=10000.0, factor=4.0))),
    # LongRoPE: one factor per frequency (head_dim 16: 8), the long ones past 32 tokens
    "phi3_longrope": ("Phi3Config", dict(pad_token_id=0, original_max_position_embeddings=32, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, short_factor=[1.0, 1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0],
        long_factor=[1.0, 1.3, 1.9, 2.8, 4.5, 7.0, 11.0, 16.0]))),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=False)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, use_sliding_window=False)),
    "mistral": ("MistralConfig", dict(sliding_window=32)),
    "qwen2_window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=24, max_window_layers=1)),
    "granite": ("GraniteConfig", dict(embedding_multiplier=3.0, residual_multiplier=0.5,
                                      attention_multiplier=0.05, logits_scaling=2.5)),
    "olmo2": ("Olmo2Config", dict()),
    "phi3": ("Phi3Config", dict(sliding_window=40, pad_token_id=0)),
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=24,
                                    attn_logit_softcapping=1.5, final_logit_softcapping=4.0,
                                    num_hidden_layers=3, tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=24,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        num_hidden_layers=3, tie_word_embeddings=True, rope_parameters={
                                            "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e6),
                                            "sliding_attention": dict(rope_type="default", rope_theta=100.0)})),
}

PROMPT = torch.randint(3, 49152, (100,), generator=torch.Generator().manual_seed(5)).tolist()
SHORT = [1, 450, 3000, 17, 99, 4093]
ACROSS = PROMPT[:24]   # its generation passes 32 tokens: dynamic NTK's and LongRoPE's original length
NEW_TOKENS = 16


def build_hf_checkpoint(family: str, out) -> str:
    """transformers builds the model from its own config class; weights re-drawn larger than
    its init (std 0.2; norms 1 + 0.1 n) so greedy tokens vary and no two logits nearly tie."""
    cls_name, extra = FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**_BASE, **extra})
    torch.manual_seed(0)
    # eager: its mask (sliding windows included) is the reference
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)
    model.save_pretrained(out)
    default_tokenizer().save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> checkpoint directory, built on first use."""
    root, built = tmp_path_factory.mktemp("families"), {}

    def get(family: str) -> str:
        if family not in built:
            built[family] = build_hf_checkpoint(family, root / family)
        return built[family]
    return get


def engine(path: str, dtype: str = "float32", **kw) -> Engine:
    return Engine(EngineConfig(model=path, dtype=dtype, cache=CacheConfig(block_size=16, num_blocks=32), **kw))


def hf_greedy(ref, prompt: list[int]) -> list[int]:
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_greedy_keeping_the_cache(ref, prompt: list[int]) -> list[int]:
    """Phi-3's generate drops its KV cache when the sequence first passes LongRoPE's original
    length and recomputes it with the long factors; we keep the keys computed before (see
    docs/models.md): the reference then is transformers' generate without that override."""
    from transformers import GenerationMixin
    ref.prepare_inputs_for_generation = functools.partial(GenerationMixin.prepare_inputs_for_generation, ref)
    try:
        return hf_greedy(ref, prompt)
    finally:
        del ref.prepare_inputs_for_generation


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_fp32_identical_to_transformers(checkpoints, family):
    path = checkpoints(family)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    # eager: recording step graphs costs seconds per engine; test_families_served replays them
    ours = engine(path, enforce_eager=True).generate([PROMPT, SHORT, ACROSS], GREEDY)
    across = hf_greedy_keeping_the_cache if family == "phi3_longrope" else hf_greedy
    assert ours == [hf_greedy(ref, PROMPT), hf_greedy(ref, SHORT), across(ref, ACROSS)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_logits_match_transformers(checkpoints, family):
    """The logits themselves (greedy tokens cannot see a constant factor such as Granite's)."""
    test_models.test_prefill_logits_match_transformers({family: checkpoints(family)}, family)


@pytest.mark.parametrize("family", ["dynamic_rope", "phi3_longrope"])
def test_rope_by_prompt_length_survives_chunks_and_preemption(checkpoints, family):
    """Every chunk of a prompt is rotated for the whole prompt's length, and a request preempted
    (9 blocks of 16 cannot hold both sequences) is recomputed with its own prompt's length, not
    its prompt and output's: the tokens of one unchunked, unpreempted run. No prefix caching."""
    path = checkpoints(family)
    expected = engine(path, enforce_eager=True).generate([PROMPT, ACROSS], GREEDY)
    small = Engine(EngineConfig(model=path, dtype="float32", enforce_eager=True,
                                cache=CacheConfig(block_size=16, num_blocks=9),
                                scheduler=SchedulerConfig(max_num_batched_tokens=16)))
    assert not small.kv.enable_prefix_caching
    assert small.generate([PROMPT, ACROSS], GREEDY) == expected


def logits_as_generated(model, prompt: list[int], out: list[int]) -> torch.Tensor:
    """The logits [len(out), vocab] each of `out` was picked from, computed as generate does:
    the prompt in one forward, then a token at a time on the KV cache (dynamic NTK's
    frequencies follow the sequence's length: one forward of the whole sequence would rotate
    every token by its full length)."""
    rows = []
    with torch.no_grad():
        r = model(torch.tensor([prompt]), use_cache=True)
        for token in out:
            rows.append(r.logits[0, -1])
            r = model(torch.tensor([[token]]), cache=r.past_key_values, use_cache=True)
    return torch.stack(rows)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_greedy_within_bf16_rounding(checkpoints, family):
    """test_models' rule on the long prompt: each token we pick has an fp32 logit (on our own
    sequence) at most 4 * e below the best, e being transformers' own bf16 error there."""
    path = checkpoints(family)
    ref, hf_bf16 = bf16_reference(path)
    out = engine(path, "bfloat16", enforce_eager=True).generate([PROMPT], GREEDY)[0]
    exact = logits_as_generated(ref, PROMPT, out)
    hf_err = (logits_as_generated(hf_bf16, PROMPT, out).float() - exact).abs().amax(dim=-1)
    shortfall = exact.amax(dim=-1) - exact.gather(1, torch.tensor(out)[:, None])[:, 0]
    assert (shortfall <= 4 * hf_err + EPS).all(), (shortfall.tolist(), hf_err.tolist())


@pytest.mark.parametrize("family, windows", [("gemma2", (24, 0, 24)), ("gemma3", (24, 24, 0))])
def test_configs_written_before_layer_types_get_the_same_windows(checkpoints, family, windows):
    """Gemma 2 alternates from layer 0; Gemma 3 has every sliding_window_pattern-th layer full
    (transformers 5 fills layer_types so when config.json has none, as older ones do not)."""
    from tessera.models.model_config import ModelConfig
    cfg = json.loads((Path(checkpoints(family)) / "config.json").read_text())
    assert ModelConfig.from_hf(cfg).layer_windows == (24, 0, 24)
    del cfg["layer_types"]
    assert ModelConfig.from_hf(dict(cfg, sliding_window_pattern=3)).layer_windows == windows


# -- checkpoints we cannot run: one clear configuration error at start-up ---------------------

def _edit(path: str, out, config=None, drop: str | None = None) -> str:
    """A copy of checkpoint `path` with config.json updated by `config` and tensor `drop` left out."""
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(path, out)
    cfg = json.loads((out / "config.json").read_text()) | (config or {})
    (out / "config.json").write_text(json.dumps(cfg))
    if drop:
        tensors = load_file(str(out / "model.safetensors"))
        del tensors[drop]
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


@pytest.mark.parametrize("change, error", [
    (dict(config={"architectures": ["FalconForCausalLM"]}), "unsupported architectures ['FalconForCausalLM']"),
    (dict(config={"auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}), "needs its own code"),
    (dict(config={"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}}),
     "partial rotary embeddings (partial_rotary_factor < 1) are not supported"),
    (dict(drop="model.layers.1.mlp.down_proj.weight"), "missing tensors for 1 parameters, e.g. ['layers.1.ffn.mlp"),
    (dict(config={"attention_bias": True}), "missing tensors"),
])
def test_what_we_cannot_run_is_one_config_error(checkpoints, tmp_path, change, error):
    from tessera.config import ConfigError
    from tessera.models.loader import load_model
    with pytest.raises(ConfigError, match=re.escape(error)):
        load_model(_edit(checkpoints("qwen3"), tmp_path / "m", **change))


def test_a_worker_given_custom_code_exits_78_once_with_the_reason(checkpoints, tmp_path):
    """Exit 78: the supervisor of `tessera serve` does not restart it (a restart fails the same way)."""
    path = _edit(checkpoints("qwen3"), tmp_path / "m", config={"auto_map": {"AutoConfig": "configuration_x.XConfig"}})
    out = subprocess.run([sys.executable, "-m", "tessera.cli", "worker", "--model", path, "--port", "0"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 78 and "needs its own code (auto_map ['AutoConfig'])" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


# -- every path: the same greedy tokens monolithic, speculative, in shards, attention-FFN split --

# the families whose FFN half differs (norms around it, fused weights, Granite's multiplier):
# the AFD path splits only the FFN, whose math the others share with one of these
AFD_FAMILIES = ("gemma2", "gemma3", "granite", "mistral", "olmo2", "phi3")
# linear and YaRN scaling only change the frequencies, as llama3's does: nothing a split sees
ON_EVERY_PATH = sorted(set(FAMILIES) - {"linear_rope", "yarn_rope"})


@pytest.mark.parametrize("family", ON_EVERY_PATH)
def test_monolithic_equals_speculative_pipeline_and_afd(checkpoints, family):
    """Tree verification attends with explicit masks (within the window; Gemma 2: soft-capped)
    and positions (RoPE scaling that depends on the prompt's length sees them too), the shards
    run each a layer range of the same driver, and on the AFD path two expert nodes hold half
    the MLP columns each while the attention node keeps the norms around them."""
    from test_disagg_inprocess import afd_engine
    from test_pipeline_inprocess import WHOLE_STEP, close, pipeline
    from tessera.tokenizer import load_tokenizer
    path = checkpoints(family)
    expected = engine(path, enforce_eager=True).generate([PROMPT], GREEDY)
    spec = engine(path, enforce_eager=True, speculative=SpeculativeConfig(draft="self:1"))
    assert spec.generate([PROMPT], GREEDY) == expected
    assert spec.spec_stats.accepted_tokens > 0
    config = EngineConfig(model=path, dtype="float32", enforce_eager=True, cache=CacheConfig(block_size=16, num_blocks=32))
    layers = spec.model_config.num_layers
    first, shards = pipeline(config, ["0:1", f"1:{layers}"], load_tokenizer(path), micro_batches=1, prefill=WHOLE_STEP)
    try:
        assert first.generate([PROMPT], GREEDY) == expected
    finally:
        close(shards)
    if family not in AFD_FAMILIES:
        return
    afd, workers = afd_engine(path, load_tokenizer(path), nodes=2, micro_batches=1)
    try:
        assert afd.generate([PROMPT], GREEDY) == expected
    finally:
        afd.runner.stop_experts()
        for w in workers:
            w.join()
