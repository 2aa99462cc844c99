"""The quantization-sensitivity indicator and the perplexity it is validated against."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from tessera.layers.quant import fake_quant
from tessera.models.loader import load_model
from tessera.pipeline import indicator, quality


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return load_model(tiny_models["llama"], torch.float32)[0], tiny_models["llama"]


def test_perplexity_equals_transformers_loss(tiny):
    from transformers import AutoModelForCausalLM
    model, path = tiny
    windows = [[(7 * i + 3) % 5000 + 10 for i in range(40)], [(11 * i) % 3000 + 5 for i in range(40)]]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        losses = [ref(torch.tensor([w]), labels=torch.tensor([w])).loss.item() for w in windows]
    assert quality.perplexity(model, windows) == pytest.approx(math.exp(sum(losses) / 2), rel=1e-4)


def test_omega_predicts_the_measured_output_error():
    """ω of one linear is the expected squared output error per token that RTN noise causes:
    check it against the error actually measured on inputs of the calibrated statistics."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 64, bias=False)
    x = torch.randn(4000, 256) * torch.linspace(0.2, 2.0, 256)
    stats = indicator.LinearStats(x.pow(2).sum(0), tokens=x.shape[0], weight=lin.weight)
    for bits in (3, 4, 8):
        predicted = indicator.omega([{"l": stats}], bits=(bits,))[0][0]
        err = x @ (fake_quant(lin.weight, bits) - lin.weight).T
        measured = err.pow(2).sum(1).mean().item()
        assert predicted == pytest.approx(measured, rel=0.25), bits


def test_calibration_ranks_bits_and_sees_every_linear(tiny):
    model, _ = tiny
    windows = [[(13 * i) % 4000 + 20 for i in range(48)] for _ in range(2)]
    stats = indicator.calibrate(model, windows)
    assert [sorted(s) for s in stats] == [["attn.o_proj", "attn.qkv_proj", "ffn.mlp.down_proj",
                                           "ffn.mlp.gate_up_proj"]] * len(model.layers)
    assert all(s.tokens == 96 for layer in stats for s in layer.values())
    for row in indicator.omega(stats):
        assert row[0] > row[1] > row[2] > row[3] == 0.0    # 3 > 4 > 8 > 16 bits
    # quantizing weights never changes what calibration saw: hooks are gone afterwards
    assert all(not lin._forward_pre_hooks for layer in model.layers for lin in layer.modules())


def test_kl_indicator_equals_the_kl_of_whole_quantized_passes(tiny):
    """omega_kl reruns only the layers from l on: the answer must be the KL of a whole forward
    with layer l quantized, for every layer and bit-width (and 0 at 16 bits)."""
    model, _ = tiny
    windows = [[(13 * i) % 4000 + 20 for i in range(40)], [(7 * i + 1) % 3000 + 9 for i in range(40)]]
    got = indicator.omega_kl(model, windows, bits=(3, 8, 16))

    def log_probs():
        return [torch.log_softmax(model.compute_logits(model.norm(quality.hidden_states(model, w)[0])), -1)
                for w in windows]
    reference = log_probs()
    for l, layer in enumerate(model.layers):
        for i, b in enumerate((3, 8)):
            with indicator.quantized(layer, b):
                quant = log_probs()
            kl = sum(float((r.exp() * (r - q)).sum()) for r, q in zip(reference, quant)) / 80
            assert got[l][i] == pytest.approx(kl, rel=1e-4, abs=1e-9), (l, b)
        assert got[l][2] == 0.0
        assert got[l][0] > got[l][1] > 0.0
    assert log_probs()[0].equal(reference[0])         # every layer's weights are back


def test_indicator_command_writes_every_form_and_validates(tiny, tmp_path):
    _, path = tiny
    out = tmp_path / "omega.json"
    run = subprocess.run([sys.executable, "-m", "tessera.cli", "indicator", "--model", path, "--out", str(out),
                          "--windows", "1", "--kl-windows", "1", "--window-len", "48", "--validate",
                          "--validate-windows", "1", "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    data = json.loads(out.read_text())
    assert data["omega_kind"] == "kl" and data["omega"] == data["omega_kl"]
    assert {"omega_variance", "omega_paper"} <= set(data)
    assert len(data["omega"]) == len(data["validation"]["delta_perplexity"])
    assert {"spearman_kl", "spearman_variance", "spearman_paper"} <= set(data["validation"])


def test_heldout_and_calibration_texts_do_not_overlap():
    cal, held = quality.corpus("calibration"), quality.corpus("heldout")
    assert len(cal) > 100_000 and len(held) > 100_000
    assert held[:2000] not in cal and cal[:2000] not in held


def test_spearman():
    assert indicator.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert indicator.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
