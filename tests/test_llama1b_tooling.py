"""The 1B-class benchmark's tooling: `tessera bench make-llama1b` writes Llama 3.2 1B's
architecture (here scaled down to 2 layers of hidden 256, the vocabulary and RoPE kept) as a
checkpoint transformers and Tessera load, seeded and written once; `tessera bench roofline`
counts the bytes one decode token reads, and the FLOPs one token costs in the linears, as a hand
count from the shapes does; bench/llama1b_results.py puts each round's runs against that round's
roofs."""
from __future__ import annotations

import collections
import hashlib
import json
import math
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from tessera.bench.llama1b import Shape, hf_config
from tessera.bench.memory_roofline import linear_shapes, roofline, stream_read_gbs, weight_bytes_per_token
from tessera.models.model_config import ModelConfig

SMALL = dict(layers=2, hidden=256, heads=4, kv_heads=1, intermediate=1024)
SMALL_ARGS = [a for k, v in SMALL.items() for a in (f"--{k.replace('_', '-')}", str(v))]
# Llama 3.2 1B's config.json, as Meta publishes it (the vocabulary aside)
LLAMA_3_2_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, hidden_act="silu", initializer_range=0.02)
LLAMA3_ROPE = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


def tessera(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "tessera.cli", *args], capture_output=True, text=True,
                          timeout=600, check=True).stdout


def build(out, *extra: str):
    tessera("bench", "make-llama1b", "--out", str(out), *SMALL_ARGS, *extra)
    return out


def digest(path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return build(tmp_path_factory.mktemp("llama1b") / "small")


def test_the_default_shape_is_llama_3_2_1b():
    cfg = hf_config(Shape(), bos_token_id=1, eos_token_id=2).to_dict()
    assert {k: cfg[k] for k in LLAMA_3_2_1B} == LLAMA_3_2_1B
    assert cfg["vocab_size"] == 49152
    assert cfg["rope_parameters"] == {**LLAMA3_ROPE, "rope_theta": 500000.0}


def test_transformers_loads_the_checkpoint_with_llama_3_2_1b_fields(small):
    cfg = AutoConfig.from_pretrained(small)
    full = hf_config(Shape(), bos_token_id=1, eos_token_id=2).to_dict()
    mine = cfg.to_dict()
    same = [k for k in LLAMA_3_2_1B if k not in SHAPE_FIELDS]
    assert {k: mine[k] for k in same} == {k: full[k] for k in same}
    assert [mine[k] for k in SHAPE_FIELDS] == [256, 1024, 2, 4, 1]
    assert (mine["vocab_size"], mine["bos_token_id"], mine["eos_token_id"]) == (49152, 1, 2)
    assert mine["rope_parameters"] == {**LLAMA3_ROPE, "rope_theta": 500000.0}
    raw = json.loads((small / "config.json").read_text())   # what a transformers 4 reader sees
    assert raw["rope_scaling"] == LLAMA3_ROPE and raw["rope_theta"] == 500000.0
    gen = GenerationConfig.from_pretrained(small)
    assert (gen.bos_token_id, gen.eos_token_id) == (1, 2)
    model = AutoModelForCausalLM.from_pretrained(small)
    assert model.dtype == torch.bfloat16
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # transformers' own init: normal with std initializer_range, norms one
    assert abs(model.model.layers[0].mlp.up_proj.weight.float().std().item() - 0.02) < 1e-3
    assert torch.equal(model.model.norm.weight, torch.ones(256, dtype=torch.bfloat16))


def test_tessera_reads_the_rope_and_the_tied_head(small):
    mc = ModelConfig.from_hf(json.loads((small / "config.json").read_text()))
    assert dict(mc.rope_scaling) == LLAMA3_ROPE and mc.rope_theta == 500000.0
    assert mc.tie_word_embeddings and (mc.num_heads, mc.num_kv_heads, mc.head_dim) == (4, 1, 64)


def test_the_build_is_seeded_and_written_once(small, tmp_path):
    before = (small / "model.safetensors").stat().st_mtime_ns
    build(small)
    assert (small / "model.safetensors").stat().st_mtime_ns == before
    again = build(tmp_path / "again")
    assert digest(again) == digest(small)
    other = build(tmp_path / "again", "--seed", "1")     # other arguments: built anew
    assert digest(other) != digest(small)


def test_bytes_per_token_is_the_hand_count(small):
    h, layers, q, kv, inter, vocab = 256, 2, 4 * 64, 64, 1024, 49152
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h
    by_hand = 2 * (layers * per_layer + h + vocab * h)     # bf16; the tied embedding once, as the head
    assert weight_bytes_per_token(small) == by_hand
    assert weight_bytes_per_token(small, "float32") == 2 * by_hand


def test_the_linears_are_the_hand_count_and_their_flops_two_per_weight(small):
    h, layers, q, kv, inter, vocab = 256, 2, 4 * 64, 64, 1024, 49152
    by_hand = collections.Counter()          # (in, out) -> count: q, k, v, o, gate, up, down; the tied head once
    for shape, count in (((h, q), layers), ((h, kv), 2 * layers), ((q, h), layers), ((h, inter), 2 * layers),
                         ((inter, h), layers), ((h, vocab), 1)):
        by_hand[shape] += count
    assert linear_shapes(small) == by_hand
    r = json.loads(tessera("bench", "roofline", "--model", str(small), "--bandwidth-gbs", "10", "--gemm-rows", "16",
                           "--json"))
    norms = 2 * (layers * 2 * h + h)           # bytes of the norm weights, which do no matmul
    assert r["flop_per_token"] == weight_bytes_per_token(small) - norms     # 2 FLOPs per bf16 weight of 2 bytes
    assert r["gemm_rows"] == 16 and math.isfinite(r["gemm_gflops"]) and r["gemm_gflops"] > 0


def test_an_untied_embedding_is_not_counted(tmp_path):
    save_file({"model.embed_tokens.weight": torch.zeros(10, 4), "lm_head.weight": torch.zeros(10, 4),
               "model.norm.weight": torch.zeros(4)}, str(tmp_path / "model.safetensors"))
    assert weight_bytes_per_token(tmp_path) == (40 + 4) * 4


def test_the_roofline_and_its_fraction(small):
    r = json.loads(tessera("bench", "roofline", "--model", str(small), "--bandwidth-gbs", "10",
                           "--tpot-ms", "20", "--json"))
    roof_ms = weight_bytes_per_token(small) / 10e9 * 1e3
    assert r["roofline_tpot_ms"] == pytest.approx(roof_ms, abs=1e-3)
    assert r["fraction"] == pytest.approx(20 / roof_ms, rel=1e-3)
    assert roofline(small, 10.0)["weight_bytes_per_token"] == r["weight_bytes_per_token"]


def test_the_streaming_read_bandwidth_is_a_positive_number():
    gbs = stream_read_gbs(gib=1 / 64, threads=1, repeats=2)
    assert math.isfinite(gbs) and gbs > 0
