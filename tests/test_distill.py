"""`tessera draft distill` (spec/distill.py): the teacher's targets line up with the student's
positions, and the checkpoint it writes drafts losslessly for its target."""
from __future__ import annotations

import json

import pytest
import torch

from tessera import cli
from tessera.config import SamplingParams
from tessera.models.loader import load_model
from tessera.spec import distill as D
from tessera.tokenizer import load_tokenizer
from test_spec import PROMPTS, engine, run    # noqa: I001 (tests/ is on the path, as for servers)


def test_a_student_holding_every_target_layer_agrees_everywhere(tiny_models):
    """With all of the target's layers in order the student is the target: it must agree on
    every answer position and its KL to the teacher must vanish (a shifted position, a wrong
    weight name or a wrong top-k would show here)."""
    path = tiny_models["llama"]
    model, _ = load_model(path, torch.float32)
    cfg = D.DistillConfig(target=path, prompts=3, answer_tokens=6, dtype="float32", top_k=8)
    samples = D.generate_answers(model, load_tokenizer(path), cfg)
    D.teach(model, samples, cfg.top_k)
    assert samples and all(len(s.top_ids) == len(s.tokens) - s.start for s in samples)
    whole, _ = D.student_from_target(path, (0, 1))
    assert D.agreement(whole, samples) == (1.0, 1.0)
    with torch.no_grad():
        for s in samples:
            logits = whole(torch.tensor([s.tokens[:-1]]), logits_to_keep=len(s.top_ids)).logits[0]
            assert D.kl_to_teacher(logits, s.top_ids, s.top_logp) < 1e-4
    half, _ = D.student_from_target(path, (1,))
    assert D.agreement(half, samples)[0] < 1.0


def test_distill_command_writes_a_draft_that_trains_and_drafts_losslessly(tiny_models, tmp_path):
    path, out = tiny_models["llama"], tmp_path / "draft"
    assert cli.main(["draft", "distill", path, "--out", str(out), "--prompts", "6", "--answer-tokens", "8",
                     "--train-seconds", "600", "--train-steps", "60", "--layers", "-1", "--dtype", "float32",
                     "--top-k", "8"]) == 0
    report = json.loads((out / "distill.json").read_text())
    assert report["config"]["layers"] == [1] and report["trained_answers"] == 60
    assert report["kl_last_tenth"] < report["kl_first_tenth"]
    assert load_model(str(out), torch.float32)[0].config.num_layers == 1
    sampling = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert run(engine(path, str(out)), PROMPTS, sampling) == run(engine(path), PROMPTS, sampling)


@pytest.mark.parametrize("flags,message", [
    (["--layers", "0,0"], "distinct"), (["--layers", "5"], "--layers"), (["--layers", "x"], "comma-separated"),
    (["--lr", "0"], "--lr"), (["--top-k", "100000"], "--top-k"), (["--prompts", "1"], "--prompts"),
    (["--out", "EXISTING"], "not an empty directory"),
])
def test_distill_refuses_bad_flags_before_any_work(tiny_models, tmp_path, capsys, flags, message):
    """Refused at once with exit 2 and a message naming the flag (no minutes of generation first);
    an existing --out (the target's own directory, say) is never overwritten."""
    path = tiny_models["llama"]
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "config.json").write_text("{}")
    flags = [str(existing) if f == "EXISTING" else f for f in flags]
    out = ["--out", str(tmp_path / "new")] if "--out" not in flags else []
    layers = ["--layers", "0"] if "--layers" not in flags else []    # the default 0,1,2,3: this target has 2
    assert cli.main(["draft", "distill", path, *out, *layers, *flags]) == 78   # a configuration error
    assert message in capsys.readouterr().err
    assert (existing / "config.json").read_text() == "{}" and not (tmp_path / "new").exists()


def test_a_quantized_checkpoint_is_not_a_target(tiny_models, tmp_path, capsys):
    q = tmp_path / "q"
    assert cli.main(["quantize", tiny_models["llama"], "--bits", "int8", "--out", str(q)]) == 0
    assert cli.main(["draft", "distill", str(q), "--out", str(tmp_path / "d"), "--layers", "0"]) == 78
    assert "dense Llama-family" in capsys.readouterr().err
