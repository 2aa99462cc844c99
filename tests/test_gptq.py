"""GPTQ (layers/gptq.py, pipeline/gptq_pass.py): the same codes as round-to-nearest where
there is nothing to correct, less output error where inputs are correlated, and a checkpoint
that `tessera quantize --method gptq` writes and the engine serves with exactly those codes."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tessera.layers.gptq import gptq
from tessera.layers.quant import fake_quant, layer_linears, quantize_rtn
from tessera.models.loader import load_model
from tessera.pipeline import quality
from tessera.pipeline.gptq_pass import gptq_codes


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_uncorrelated_inputs_give_round_to_nearest_codes(bits):
    """H a multiple of I: no error to spread, so every code, scale and offset is quantize_rtn's."""
    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(bits))
    got, rtn = gptq(w, 7.0 * torch.eye(128), bits, 32), quantize_rtn(w, bits, 32)
    assert torch.equal(got.codes, rtn.codes) and torch.equal(got.scale, rtn.scale)
    assert torch.equal(got.offset, rtn.offset) and got.group == rtn.group


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_correlated_inputs_get_less_output_error_than_round_to_nearest(bits):
    """On the calibration inputs X, ||X (W - Q)^T||^2 at most half round-to-nearest's (about a
    fifth here), with codes in the format's range."""
    g = torch.Generator().manual_seed(10 + bits)
    k = 256
    w = torch.randn(192, k, generator=g)
    x = torch.randn(2048, k, generator=g) @ (torch.eye(k) + 2 * torch.randn(k, k, generator=g) / k ** 0.5)
    x[:, :8] *= 10                                      # a few outlier features, as LLM activations have
    q = gptq(w, x.T @ x, bits, 32)
    lo, hi = (-127, 127) if bits == 8 else (0, 2 ** bits - 1)
    assert int(q.codes.min()) >= lo and int(q.codes.max()) <= hi and q.dequantize().shape == w.shape
    err = ((x @ (w - q.dequantize()).T) ** 2).mean()
    rtn = ((x @ (w - quantize_rtn(w, bits, 32).dequantize()).T) ** 2).mean()
    assert err < 0.5 * rtn


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tessera.models.random_init import write_random_model
    return str(write_random_model("llama", tmp_path_factory.mktemp("g") / "llama4", seed=3, num_hidden_layers=4))


WINDOWS = [[(13 * i) % 4000 + 20 for i in range(48)], [(7 * i + 1) % 3000 + 9 for i in range(48)]]


@pytest.mark.parametrize("bits", [3, 4])
def test_gptq_pass_keeps_the_model_closer_than_round_to_nearest(tiny_llama, bits):
    """Every layer quantized, last hidden states on the calibration windows: GPTQ's squared
    error against the dense model below 0.85 of round-to-nearest's (0.71 / 0.55 here)."""
    dense = load_model(tiny_llama, torch.float32)[0]
    ref = [quality.hidden_states(dense, w)[0] for w in WINDOWS]
    fitted = load_model(tiny_llama, torch.float32)[0]
    codes = gptq_codes(fitted, WINDOWS, bits, 32)
    assert len(codes) == 4 * len(layer_linears(fitted.layers[0]))
    rounded = load_model(tiny_llama, torch.float32)[0]
    with torch.inference_mode():
        for layer in rounded.layers:
            for _, lin in layer_linears(layer):
                lin.weight.copy_(fake_quant(lin.weight, bits, 32))

    def error(model):
        return sum(float(((quality.hidden_states(model, w)[0] - r) ** 2).mean()) for w, r in zip(WINDOWS, ref))
    assert error(fitted) < 0.85 * error(rounded)


def test_quantize_gptq_writes_a_checkpoint_the_engine_serves(tiny_llama, tmp_path):
    """`tessera quantize --method gptq` as a user runs it: the directory holds GPTQ's codes
    (those of the same pass run here) and serves them."""
    out = tmp_path / "q"
    done = subprocess.run([sys.executable, "-m", "tessera.cli", "quantize", tiny_llama, "--bits", "int4",
                           "--method", "gptq", "--calibration-windows", "2", "--eval-windows", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "gptq" in done.stdout and "held-out perplexity" in done.stdout
    from tessera.tokenizer import load_tokenizer
    model = load_model(tiny_llama, torch.float32)[0]
    codes = gptq_codes(model, quality.windows(load_tokenizer(tiny_llama), "calibration", 2, 256), 4, 32)
    served = load_model(str(out), torch.float32)[0]
    linear = served.layers[2].attn.qkv_proj
    q = codes["layers.2.attn.qkv_proj"]
    from tessera_kernels.gemv_quant_cpu import pack_q4
    assert linear.bits == 4 and torch.equal(linear.packed, pack_q4(q.codes))
    assert torch.equal(linear.scale, q.scale) and torch.equal(linear.offset, q.offset)
    from tessera.config import EngineConfig, SamplingParams
    from tessera.engine import Engine
    out_tokens = Engine(EngineConfig(model=str(out), dtype="float32")).generate(
        [[9, 80, 700]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out_tokens[0]) == 4
