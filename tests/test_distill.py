"""`tessera draft distill` (spec/distill.py): the teacher's targets line up with the student's
positions, and the checkpoint it writes drafts losslessly for its target."""
from __future__ import annotations

import json

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
                     "--train-seconds", "3", "--layers", "-1", "--dtype", "float32", "--top-k", "8"]) == 0
    report = json.loads((out / "distill.json").read_text())
    assert report["config"]["layers"] == [1] and report["kl_last_tenth"] < report["kl_first_tenth"]
    assert load_model(str(out), torch.float32)[0].config.num_layers == 1
    sampling = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert run(engine(path, str(out)), PROMPTS, sampling) == run(engine(path), PROMPTS, sampling)
