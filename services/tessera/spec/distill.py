"""`tessera draft distill`: a small draft model distilled from the target, saved as a normal
Hugging Face checkpoint that `--speculative PATH` (or any transformers user) loads.

    1. data     the target answers prompts that ship with the repository (distill_prompts.txt,
                and instructions over excerpts of the calibration half of pydoc_data.topics;
                the bench's own prompts and the topic its summarisation prompt quotes are left
                out), greedily, as it will when it serves: the draft must predict these tokens.
    2. teacher  one whole-sequence forward of the target per answer gives its next-token
                distribution at every position; the top `top_k` log-probabilities are kept.
    3. student  K of the target's layers (its embedding, final norm and tied head included),
                trained for a time budget to minimise KL(teacher || student) over the answer
                positions, the teacher's tail mass folded into one "rest" bucket. The embedding
                and head stay frozen: they are the target's, so the draft's hidden states only
                have to land where the target's would.
    4. output   config.json + model.safetensors + the tokenizer, and distill.json with what was
                done and the held-out top-1 agreement with the target before and after.

A draft is worth its cost when it agrees with the target on the next token often and runs many
times faster; on a 30-layer target a 3-4 layer student costs ~1/8 of a target step.
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import random
import time
from dataclasses import dataclass

import torch

from tessera.config import ConfigError

PROMPTS_FILE = pathlib.Path(__file__).with_name("distill_prompts.txt")
BENCH_TOPIC = "exceptions"    # bench/prompts/summarisation.txt quotes it: never train on it
INSTRUCTIONS = ("Explain what this part of the Python documentation says:\n\n{}",
                "Summarise the following text in a few sentences:\n\n{}",
                "What are the key points of this passage?\n\n{}",
                "Write a short Python example that illustrates this:\n\n{}")


@dataclass(frozen=True)
class DistillConfig:
    target: str = "smollm2"
    out: str = "draft-distilled"
    layers: tuple[int, ...] = (0, 1, 2, 3)    # the target's layers the student starts from
    prompts: int = 360             # answers generated (hand-written prompts first, then pydoc ones)
    answer_tokens: int = 160
    train_seconds: float = 240.0
    train_steps: int | None = None  # and at most this many answers (None: the time budget alone)
    lr: float = 3e-4
    top_k: int = 64
    heldout: float = 0.1           # share of the answers kept to measure agreement
    dtype: str = "bfloat16"        # the target's dtype while generating and teaching
    seed: int = 0
    threads: int | None = None


@dataclass
class Sample:
    tokens: list[int]              # prompt + answer
    start: int                     # first answer position
    top_ids: torch.Tensor | None = None     # [len - start, top_k] teacher's most likely next ids
    top_logp: torch.Tensor | None = None    # [len - start, top_k] their log-probabilities


EXCERPT, SHORTEST = 700, 200   # characters: a passage ~150-200 tokens long; shorter tails skipped


def prompt_texts(count: int, seed: int) -> list[str]:
    """Hand-written prompts, then instructions over excerpts of the calibration topics."""
    from tessera.pipeline.quality import split_topics
    texts = [t for t in PROMPTS_FILE.read_text().splitlines() if t.strip()]
    excerpts = [text[i:i + EXCERPT] for name, text in split_topics("calibration").items() if name != BENCH_TOPIC
                for i in range(0, len(text), EXCERPT) if len(text) - i > SHORTEST]
    rng = random.Random(seed)
    rng.shuffle(excerpts)
    texts += [INSTRUCTIONS[i % len(INSTRUCTIONS)].format(e.strip()) for i, e in enumerate(excerpts)]
    return texts[:count]


def generate_answers(model, tokenizer, cfg: DistillConfig) -> list[Sample]:
    """The target's greedy answers, batched through the engine as it serves them."""
    from tessera.config import CacheConfig, EngineConfig, SamplingParams
    from tessera.engine import Engine
    from tessera.tokenizer import user_message_ids
    prompts = [user_message_ids(tokenizer, t) for t in prompt_texts(cfg.prompts, cfg.seed)]
    engine = Engine(EngineConfig(model=cfg.target, dtype=cfg.dtype, cache=CacheConfig(kv_cache_gib=2.0)),
                    model=model, tokenizer=tokenizer)   # 2 GiB: SmolLM2's KV for ~5,700 tokens in flight
    answers = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=cfg.answer_tokens))
    samples = [Sample(p + a, len(p)) for p, a in zip(prompts, answers) if len(a) > 1]
    if len(samples) < 2:
        raise ConfigError(f"the target gave {len(samples)} answers longer than one token: at least 2 are "
                          "needed (one to hold out, one to train on)")
    return samples


def teach(model, samples: list[Sample], top_k: int) -> None:
    """Fill each sample's teacher targets: the target's top_k next-token log-probabilities at
    every position that predicts an answer token (start - 1 .. len - 2)."""
    from tessera.model_runner import ModelRunner
    from tessera.pipeline.quality import hidden_states
    runner = ModelRunner(model, -(-max(len(s.tokens) for s in samples) // 16), 16)
    for s in samples:
        with torch.inference_mode():
            x, _ = hidden_states(model, s.tokens, runner=runner)
            logp = torch.log_softmax(model.compute_logits(model.norm(x[s.start - 1:-1])).float(), -1)
            top = logp.topk(top_k, dim=-1)
        s.top_logp, s.top_ids = top.values.clone(), top.indices.clone()   # usable by autograd


def kl_to_teacher(student_logits: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher || student), the teacher given by its top-k
    probabilities and the rest of its mass in one bucket (compared with the student's rest)."""
    logq = torch.log_softmax(student_logits.float(), -1)
    q_top = logq.gather(-1, top_ids)
    p_top = top_logp.exp()
    p_rest = (1 - p_top.sum(-1)).clamp_min(1e-8)
    q_rest = (1 - q_top.exp().sum(-1)).clamp_min(1e-8)
    kl = (p_top * (top_logp - q_top)).sum(-1) + p_rest * (p_rest.log() - q_rest.log())
    return kl.mean()


def student_from_target(target: str, layers: tuple[int, ...]):
    """A transformers LlamaForCausalLM holding the target's `layers` (renumbered 0..K-1), its
    embedding, final norm and head, in float32 for training."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tessera.models.loader import iter_checkpoint, load_config, resolve_model_path
    from tessera.vllm_backend.hf_export import hf_config
    path = resolve_model_path(target)
    hf = hf_config(load_config(path)) | {"num_hidden_layers": len(layers)}
    rename = {f"model.layers.{src}.": f"model.layers.{dst}." for dst, src in enumerate(layers)}
    state = {}
    for name, read in iter_checkpoint(path):
        if not name.startswith("model.layers."):
            state[name] = read().float()
            continue
        prefix = ".".join(name.split(".")[:3]) + "."
        if prefix in rename:
            state[rename[prefix] + name[len(prefix):]] = read().float()
    student = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in hf.items() if k != "architectures"}))
    missing, unexpected = student.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"student weights do not match: missing {missing}, unexpected {unexpected}")
    student.tie_weights()
    return student, hf


def agreement(student, samples: list[Sample], width: int = 4) -> tuple[float, float]:
    """(share of answer positions where the student's argmax is the target's, share where the
    target's argmax is among the student's `width` most likely: a tree that wide keeps it)."""
    top1 = topw = total = 0
    with torch.inference_mode():
        for s in samples:
            best = student_logits(student, s).topk(width, dim=-1).indices
            top1 += (best[:, 0] == s.top_ids[:, 0]).sum().item()
            topw += (best == s.top_ids[:, :1]).any(-1).sum().item()
            total += len(s.top_ids)
    return top1 / max(total, 1), topw / max(total, 1)


def student_logits(student, s: Sample) -> torch.Tensor:
    """The student's logits at the positions the teacher's targets are for."""
    return student(torch.tensor([s.tokens[:-1]]), logits_to_keep=len(s.top_ids)).logits[0]


def train(student, samples: list[Sample], cfg: DistillConfig, log=print) -> list[float]:
    """AdamW on the decoder layers and final norm for cfg.train_seconds (or cfg.train_steps
    answers, whichever ends first); the learning rate warms up over 16 answers (AdamW's moment
    estimates start at zero) and then decays on a cosine over the budget. Returns the loss of
    every answer trained on."""
    for p in student.parameters():
        p.requires_grad_(False)
    trained = [p for n, p in student.named_parameters() if n.startswith(("model.layers.", "model.norm."))]
    for p in trained:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(trained, lr=cfg.lr, weight_decay=0.0)
    rng = random.Random(cfg.seed)
    order: list[Sample] = []
    start, seen, losses = time.monotonic(), 0, []
    steps = cfg.train_steps or math.inf
    while (done := max((time.monotonic() - start) / cfg.train_seconds, seen / steps)) < 1.0:
        if not order:
            order = samples[:]
            rng.shuffle(order)
        s = order.pop()
        for g in opt.param_groups:
            g["lr"] = cfg.lr * min(1.0, (seen + 1) / 16) * 0.5 * (1 + math.cos(math.pi * done))
        loss = kl_to_teacher(student_logits(student, s), s.top_ids, s.top_logp)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        seen += 1
        if seen % 50 == 0:
            log(f"  {time.monotonic() - start:6.0f} s  {seen} answers  KL {sum(losses[-50:]) / 50:.3f}")
    return losses


def check(cfg: DistillConfig) -> None:
    """Everything that can be refused before minutes of generation and training."""
    from tessera.models import quantized_checkpoint
    from tessera.models.loader import load_config, resolve_model_path
    path = resolve_model_path(cfg.target)
    model_cfg = load_config(path)
    if model_cfg.arch != "llama" or (path.is_dir() and quantized_checkpoint.is_quantized_checkpoint(path)):
        raise ConfigError("draft distill takes a dense Llama-family target (HF directory, .gguf or 'smollm2')")
    n = model_cfg.num_layers
    if not cfg.layers or len(set(cfg.layers)) != len(cfg.layers) or not all(0 <= i < n for i in cfg.layers):
        raise ConfigError(f"--layers must list distinct layers of the target's {n}")
    if cfg.prompts < 2 or cfg.answer_tokens < 2 or cfg.train_seconds <= 0 or cfg.lr <= 0 \
            or (cfg.train_steps is not None and cfg.train_steps < 1) or (cfg.threads is not None and cfg.threads < 1):
        raise ConfigError("--prompts and --answer-tokens must be >= 2; --train-seconds, --lr, --train-steps "
                          "and --threads > 0")
    if not 1 <= cfg.top_k <= model_cfg.vocab_size:
        raise ConfigError(f"--top-k must be in [1, {model_cfg.vocab_size}]")
    out = pathlib.Path(cfg.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not an empty directory: nothing is overwritten")


def distill(cfg: DistillConfig, log=print) -> dict:
    """The whole recipe (module docstring); returns what distill.json records."""
    check(cfg)
    from tessera.engine import resolve_dtype
    from tessera.models.loader import load_model
    from tessera.tokenizer import load_tokenizer
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    t0 = time.monotonic()
    model, _ = load_model(cfg.target, resolve_dtype(cfg.dtype))
    tokenizer = load_tokenizer(cfg.target)
    samples = generate_answers(model, tokenizer, cfg)
    t_gen = time.monotonic() - t0
    teach(model, samples, cfg.top_k)
    t_teach = time.monotonic() - t0 - t_gen
    del model
    log(f"{len(samples)} answers ({sum(len(s.top_ids) for s in samples)} tokens) generated in {t_gen:.0f} s, "
        f"taught in {t_teach:.0f} s")
    held = max(1, int(len(samples) * cfg.heldout))
    test, train_set = samples[:held], samples[held:]
    student, _ = student_from_target(cfg.target, cfg.layers)
    before = agreement(student, test)
    log(f"held-out agreement with the target before training: top-1 {before[0]:.3f}, top-4 {before[1]:.3f}")
    losses = train(student, train_set, cfg, log)
    after = agreement(student, test)
    log(f"after {len(losses)} answers: top-1 {after[0]:.3f}, top-4 {after[1]:.3f}")
    tenth = max(1, len(losses) // 10)
    out = pathlib.Path(cfg.out)
    student.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    report = {"config": dataclasses.asdict(cfg), "answers": len(samples), "heldout_answers": held,
              "answer_tokens": sum(len(s.top_ids) for s in samples), "trained_answers": len(losses),
              "kl_first_tenth": sum(losses[:tenth]) / tenth, "kl_last_tenth": sum(losses[-tenth:]) / tenth,
              "agreement_top1": [round(before[0], 4), round(after[0], 4)],   # [before, after] training
              "agreement_top4": [round(before[1], 4), round(after[1], 4)],
              "seconds": {"generate": round(t_gen, 1), "teach": round(t_teach, 1),
                          "total": round(time.monotonic() - t0, 1)}}
    (out / "distill.json").write_text(json.dumps(report, indent=2))
    return report
