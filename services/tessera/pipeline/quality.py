"""Model quality on text that ships with Python: perplexity, and the windows the indicator
calibrates on. Nothing is downloaded: the text is pydoc_data.topics (Python's own reference
manual, ~465 k characters of English and code). Its topics, in sorted order, are split in
two: the first half calibrates (tessera.pipeline.indicator), the second half is held out
for perplexity, so a plan is never judged on the text that shaped it.
"""
from __future__ import annotations

import math

import torch

from tessera.batch import ForwardBatch, build_forward_batch
from tessera.kv_cache import KVCacheManager
from tessera.model_runner import ModelRunner
from tessera.models.driver import run_layers
from tessera.models.llama import CausalLM
from tessera.scheduler import ScheduledRequest, StepPlan


def split_topics(split: str) -> dict[str, str]:
    """'calibration' or 'heldout': half of pydoc_data.topics each, by sorted topic name."""
    from pydoc_data.topics import topics
    names = sorted(topics)
    half = len(names) // 2
    chosen = names[:half] if split == "calibration" else names[half:] if split == "heldout" else None
    if chosen is None:
        raise ValueError(f"split must be 'calibration' or 'heldout', not {split!r}")
    return {n: topics[n] for n in chosen}


def corpus(split: str) -> str:
    """A split's topics as one text."""
    return "\n\n".join(split_topics(split).values())


def windows(tokenizer, split: str, num: int, length: int) -> list[list[int]]:
    """`num` consecutive token windows of `length` from the start of a split."""
    ids = tokenizer(corpus(split))["input_ids"]
    if len(ids) < num * length:
        raise ValueError(f"the {split} text has {len(ids)} tokens, fewer than {num} x {length}")
    return [ids[i * length:(i + 1) * length] for i in range(num)]


def window_batch(model: CausalLM, tokens: list[int], runner: ModelRunner | None = None
                 ) -> tuple[ForwardBatch, ModelRunner]:
    """One whole-window prefill as a batch, and a runner whose KV cache holds the window."""
    block = 16
    blocks = -(-len(tokens) // block)
    runner = runner or ModelRunner(model, blocks, block)     # windows share one length
    kv = KVCacheManager(blocks, block)
    kv.allocate("w", len(tokens))
    plan = StepPlan((ScheduledRequest("w", tuple(tokens), 0, tuple(kv.block_tables["w"]), True),))
    return build_forward_batch(plan, block), runner


@torch.inference_mode()
def hidden_states(model: CausalLM, tokens: list[int], layers: range | None = None,
                  runner: ModelRunner | None = None) -> tuple[torch.Tensor, ModelRunner]:
    """Hidden states [T, H] after `layers` (default all) of one whole-window prefill."""
    batch, runner = window_batch(model, tokens, runner)
    return run_layers(model, model.embed_tokens(batch.input_ids), batch, runner.kv_caches, layers), runner


@torch.inference_mode()
def perplexity(model: CausalLM, token_windows: list[list[int]]) -> float:
    """exp(mean next-token negative log-likelihood) over every position of every window."""
    nll, count = 0.0, 0
    runner = None
    for tokens in token_windows:
        x, runner = hidden_states(model, tokens, runner=runner)
        logits = model.compute_logits(model.norm(x[:-1]))
        target = torch.tensor(tokens[1:])
        nll += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
        count += len(tokens) - 1
    return math.exp(nll / count)
