"""Weight-only quantized linears against their fake-quant references, quantized models against
their reference twins, and GGUF Q4 blocks served as they are."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tessera.config import EngineConfig, SamplingParams
from tessera.engine import Engine
from tessera.layers.quant import (Int4Linear, Int8Linear, fake_quant, layer_linears, quantize_model,
                                  quantize_rtn, quantized_linear, reference_linear)
from tessera.models.loader import load_model


def _errors(bits: int, dtype: torch.dtype, n: int, k: int, bias: bool, seed: int, rows: int = 7) -> tuple[float, float]:
    """(max|kernel - ref_fp32|, max|torch in bf16 - ref_fp32|) for one random linear."""
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias).to(dtype)
    x = torch.randn(rows, k, dtype=dtype)
    w = fake_quant(lin.weight, bits).float()
    ref32 = x.float() @ w.T + (lin.bias.float() if bias else 0)
    kernel = quantized_linear(lin, bits)(x)
    assert kernel.dtype == dtype and kernel.shape == (rows, n)
    same_dtype = reference_linear(lin, bits)(x)
    return (kernel.float() - ref32).abs().max().item(), (same_dtype.float() - ref32).abs().max().item()


@pytest.mark.parametrize("bits", [8, 4, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,bias", [((960, 576), False), ((64, 128), True)])
def test_packed_kernel_matches_fake_quant_reference(bits, dtype, shape, bias):
    for seed in range(3):
        kernel_err, torch_err = _errors(bits, dtype, *shape, bias, seed)
        # style rule 6: within twice the error torch itself makes in the compute dtype (bf16)
        assert kernel_err <= 2 * torch_err + 1e-3, (kernel_err, torch_err)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", [1, 2, 8, 40])
def test_every_path_of_the_packed_kernels_matches_the_reference(bits, rows):
    """One row, a few (the C GEMVs), 8 (int4: the GEMV; int8: torch's packed kernel) and many
    (int4: dequantized once, then torch's GEMM; int8: torch's packed kernel)."""
    for seed in range(2):
        kernel_err, torch_err = _errors(bits, torch.bfloat16, 576, 1536, False, seed, rows)
        assert kernel_err <= 2 * torch_err + 1e-3, (kernel_err, torch_err)


def test_int4_without_the_c_kernels_dequantizes_in_torch(monkeypatch):
    """No C compiler (or TESSERA_DISABLE_CPU_KERNELS=1): the same answer from torch alone."""
    from tessera_kernels import gemv_quant_cpu
    torch.manual_seed(3)
    lin = nn.Linear(192, 64, bias=True)
    layer = quantized_linear(lin, 4)
    x = torch.randn(3, 192)
    with_kernel = layer(x)
    monkeypatch.setattr(gemv_quant_cpu, "_library", lambda: None)
    without = layer(x)
    assert (without - with_kernel).abs().max() <= 2e-2 * with_kernel.abs().max()
    assert (without - reference_linear(lin, 4)(x)).abs().max() <= 1e-2 * with_kernel.abs().max()


@pytest.mark.parametrize("bits", [8, 4])
def test_packed_weights_survive_dtype_changes_and_state_dict_loads(bits):
    """The packed format (codes, bf16 scales and offsets) is the same whatever the model's dtype:
    .half() converts the bias only (scales below fp16's range would otherwise be lost), and a
    state dict loaded with assign=True is what the layer then computes with."""
    torch.manual_seed(4)
    lin = nn.Linear(64, 32, bias=True)
    lin.weight.data[:, :32] *= 1e-6        # scales far below float16's smallest normal number
    layer = quantized_linear(lin, bits)
    scales = layer.scale.clone()
    x = torch.randn(2, 64)
    before = layer(x)
    layer.half().float()
    assert layer.scale.dtype == torch.bfloat16 and torch.equal(layer.scale, scales)
    assert (layer(x) - before).abs().max() <= 1e-2 * before.abs().max()   # only the bias went through fp16
    other = quantized_linear(nn.Linear(64, 32, bias=True), bits)
    layer.load_state_dict(other.state_dict(), assign=True)
    assert torch.equal(layer(x), other(x))


def test_int4_on_the_meta_device_never_reaches_the_c_kernel():
    layer = quantized_linear(nn.Linear(64, 32), 4).to("meta")
    assert layer.packed.device.type == "meta" and layer.scale.dtype == torch.bfloat16
    with pytest.raises((RuntimeError, NotImplementedError, ValueError)):
        layer(torch.randn(1, 64))


@pytest.mark.parametrize("bits", [8, 4, 3])
def test_round_to_nearest_codes(bits):
    torch.manual_seed(0)
    w = torch.randn(96, 256) * torch.linspace(0.1, 3, 256)   # columns of very different ranges
    q = quantize_rtn(w, bits, group_size=32)
    lo, hi = (-127, 127) if bits == 8 else (0, 2 ** bits - 1)
    assert int(q.codes.min()) >= lo and int(q.codes.max()) <= hi
    step = q.scale.float().repeat_interleave(q.group, dim=1) if bits != 8 else q.scale.float()
    # rounding to the nearest level: the error never exceeds half a step (+ bf16 scale rounding)
    assert ((w - q.dequantize()).abs() <= step * 0.5 + 1e-2 * step + 1e-6).all()


def test_fewer_bits_more_error_and_16_bits_untouched():
    torch.manual_seed(1)
    w = torch.randn(128, 256)
    errs = [(w - fake_quant(w, b)).pow(2).mean().item() for b in (8, 4, 3)]
    assert errs[0] < errs[1] < errs[2]
    assert fake_quant(w, 16) is w


@pytest.fixture(scope="module")
def tiny_llama4(tmp_path_factory):
    from tessera.models.random_init import write_random_model
    return str(write_random_model("llama", tmp_path_factory.mktemp("q") / "llama4", seed=3, num_hidden_layers=4))


def _prefill_logits(model, prompt: list[int]) -> torch.Tensor:
    from tessera.kv_cache import KVCacheManager
    from tessera.model_runner import ModelRunner
    from tessera.scheduler import ScheduledRequest, StepPlan
    kv = KVCacheManager(16, 4)
    assert kv.allocate("r", len(prompt))
    plan = StepPlan((ScheduledRequest("r", tuple(prompt), 0, tuple(kv.block_tables["r"]), True),))
    return ModelRunner(model, 16, 4).execute(plan)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_plan_matches_its_fake_quant_twin(tiny_llama4, dtype):
    bits = [16, 8, 4, 3]
    packed, _ = load_model(tiny_llama4, dtype)
    quantize_model(packed, bits)
    twin, _ = load_model(tiny_llama4, dtype)
    quantize_model(twin, bits, reference=True)
    dense, _ = load_model(tiny_llama4, dtype)
    kinds = [{type(m).__name__ for _, m in layer_linears(layer)} | {type(m).__name__ for m in layer.modules()}
             for layer in packed.layers]
    assert "Linear" in kinds[0] and "Int8Linear" in kinds[1] and "Int4Linear" in kinds[2] and "Int4Linear" in kinds[3]
    prompt = [5, 900, 31, 7000, 12, 44, 3]
    ours, ref, full = (_prefill_logits(m, prompt) for m in (packed, twin, dense))
    # the packed kernels against the same dequantized weights: rounding-level differences only,
    # far below what quantization itself changes
    assert (ours - ref).abs().max() <= 0.1 * (full - ref).abs().max() + 2e-3


def test_sixteen_bit_layers_are_the_dense_model_bit_for_bit(tiny_llama4):
    from tessera.batch import build_forward_batch
    from tessera.kv_cache import KVCacheManager
    from tessera.model_runner import ModelRunner
    from tessera.models.driver import run_layers
    from tessera.scheduler import ScheduledRequest, StepPlan
    mixed, _ = load_model(tiny_llama4, torch.float32)
    quantize_model(mixed, [16, 16, 4, 8])
    dense, _ = load_model(tiny_llama4, torch.float32)
    kv = KVCacheManager(16, 4)
    assert kv.allocate("r", 6)
    plan = StepPlan((ScheduledRequest("r", (3, 4, 5, 6, 7, 8), 0, tuple(kv.block_tables["r"]), True),))
    batch = build_forward_batch(plan, 4)
    outs = []
    for model in (mixed, dense):
        runner = ModelRunner(model, 16, 4)
        with torch.inference_mode():
            outs.append(run_layers(model, model.embed_tokens(batch.input_ids), batch, runner.kv_caches, range(0, 2)))
    assert torch.equal(outs[0], outs[1])


def test_engine_serves_quantized_and_refuses_unknown_kinds(tiny_llama4):
    from tessera.config import ConfigError
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    e = Engine(EngineConfig(model=tiny_llama4, dtype="float32", quantization="int4"))
    assert len(e.generate([[1, 2, 3, 4]], sp)[0]) == 8
    assert e.compat_hash != Engine(EngineConfig(model=tiny_llama4, dtype="float32")).compat_hash
    with pytest.raises(ConfigError):
        EngineConfig(quantization="int5")
    with pytest.raises(ValueError, match="gguf"):
        Engine(EngineConfig(model=tiny_llama4, quantization="gguf"))


def test_plan_file_sets_bits_per_layer(tiny_llama4, tmp_path):
    import json
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"bits": [8, 16, 4, 3]}))
    model, _ = load_model(tiny_llama4, torch.float32, quantization=str(plan))
    assert [getattr(layer.attn.qkv_proj, "bits", 16) for layer in model.layers] == [8, 16, 4, 3]
    plan.write_text(json.dumps({"bits": [8, 16]}))
    with pytest.raises(ValueError, match="2 bit-widths for 4 layers"):
        load_model(tiny_llama4, torch.float32, quantization=str(plan))


@pytest.fixture(scope="module")
def smollm2_q4():
    return load_model("smollm2", torch.float32, quantization="gguf")[0]


def test_gguf_q4_blocks_are_the_readers_weights(smollm2_q4):
    """Codes and scales straight from the blocks dequantize to what the dense reader produces;
    the served Int4Linear (bf16 scales) computes the dense layer up to that rounding."""
    from tessera.models.default_model import default_model_file
    from tessera.models.gguf_file import GGUFFile, dequantize
    from tessera.models.gguf_quant import q4_codes
    file = GGUFFile(str(default_model_file()))
    t = next(t for t in file.tensors if t.name == "blk.3.ffn_down.weight")
    assert torch.equal(q4_codes(t).dequantize(), torch.from_numpy(dequantize(t)))
    dense, _ = load_model("smollm2", torch.float32)
    assert all(isinstance(m, Int4Linear) for layer in smollm2_q4.layers for _, m in layer_linears(layer))
    for name in ("attn.qkv_proj", "attn.o_proj", "ffn.mlp.gate_up_proj", "ffn.mlp.down_proj"):
        x = torch.randn(4, dense.layers[7].get_submodule(name).in_features)
        want = dense.layers[7].get_submodule(name)(x)
        got = smollm2_q4.layers[7].get_submodule(name)(x)
        assert (got - want).abs().max() <= 0.02 * want.abs().max(), name


def test_gguf_q4_served_greedy_equals_dense(smollm2_q4, smollm2_engine):
    e = Engine(EngineConfig(model="smollm2", dtype="float32", quantization="gguf"), model=smollm2_q4)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ids = smollm2_engine.tokenizer("The capital of France is")["input_ids"]
    assert e.generate([ids], sp) == smollm2_engine.generate([ids], sp)


def test_int8_is_its_own_kind():
    lin = nn.Linear(64, 32)
    assert isinstance(quantized_linear(lin, 8), Int8Linear) and quantized_linear(lin, 16) is lin


def test_quantized_checkpoint_serves_what_load_time_quantization_serves(tiny_llama4, tmp_path):
    """`tessera quantize` as a user runs it, then the directory served with no --quantization."""
    import json
    import subprocess
    import sys
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"bits": [4, 8, 16, 3]}))
    out = tmp_path / "q"
    subprocess.run([sys.executable, "-m", "tessera.cli", "quantize", tiny_llama4, "--bits", str(plan),
                    "--out", str(out)], check=True, capture_output=True)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = [[9, 80, 700, 6000, 3]]
    from_dir = Engine(EngineConfig(model=str(out), dtype="float32"))
    at_load = Engine(EngineConfig(model=tiny_llama4, dtype="float32", quantization=str(plan)))
    assert from_dir.generate(prompt, sp) == at_load.generate(prompt, sp)
    assert [getattr(layer.attn.qkv_proj, "bits", 16) for layer in from_dir.runner.model.layers] == [4, 8, 16, 3]
    with pytest.raises(ValueError, match="already quantized"):
        load_model(str(out), torch.float32, quantization="int8")
