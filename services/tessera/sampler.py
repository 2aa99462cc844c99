"""Sampling as a pure function of (logits, SamplingBatch): same inputs, same tokens.

Order: logprobs of the raw logits (what OpenAI clients see, as in vLLM; before any grammar
mask) -> penalties -> logit_bias -> the structured-output mask -> min_tokens masking (unless
the grammar allows nothing else) -> greedy argmax, or temperature -> top_k -> top_p -> min_p
-> a draw by the exponential race argmax(p / E), E ~ Exp(1). A request with a seed draws E
from a generator seeded by (seed, output position) (seeds.py), so its tokens depend neither on
what else is in the batch nor on which replica or step produced the earlier tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tessera.config import SamplingParams
from tessera.seeds import draw_seed
from tessera.structured import masks
from tessera_kernels.argmax_cpu import argmax_rows


@dataclass
class SamplingBatch:
    params: list[SamplingParams]
    output_ids: list[list[int]]          # tokens generated so far, per row
    prompt_ids: list[list[int]]          # for the repetition penalty
    banned_ids: list[tuple[int, ...]]    # ids masked this step (EOS/stop ids before min_tokens)
    grammar_rows: list[int] = field(default_factory=list)   # rows a structured output constrains
    grammar_mask: torch.Tensor | None = None     # their allowed ids (structured/masks.py), one row each


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: torch.Tensor | None        # [B] logprob of each sampled token
    top_ids: torch.Tensor | None         # [B, K] when any row asked for top logprobs
    top_logprobs: torch.Tensor | None


def sample(logits: torch.Tensor, batch: SamplingBatch,
           default_generator: torch.Generator | None = None) -> SampleResult:
    logits = logits.float()
    if _edits_logits(batch):
        logits = logits.clone()     # pure: the caller's logits are never modified
    want_lp = [p.logprobs is not None for p in batch.params]
    raw_lp = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
    logits = apply_penalties(logits, batch)
    for row, p in enumerate(batch.params):
        if p.logit_bias:
            ids, bias = zip(*p.logit_bias)
            logits[row, list(ids)] += torch.tensor(bias)
    if batch.grammar_rows:
        masks.apply(logits, batch.grammar_rows, batch.grammar_mask)
    for row, banned in enumerate(batch.banned_ids):
        if banned:
            kept = logits[row, list(banned)].clone()
            logits[row, list(banned)] = float("-inf")
            if row in batch.grammar_rows and not torch.isfinite(logits[row]).any():
                logits[row, list(banned)] = kept    # the grammar is complete: min_tokens yields to it
    tokens = argmax_rows(logits)
    random_rows = [i for i, p in enumerate(batch.params) if not p.greedy]
    if random_rows:
        idx = torch.tensor(random_rows)
        probs = _filtered_probs(logits[idx], [batch.params[i] for i in random_rows])
        noise = torch.empty_like(probs)
        for j, row in enumerate(random_rows):
            noise[j].exponential_(generator=_generator(batch, row) or default_generator)
        tokens[idx] = (probs / noise).argmax(dim=-1)
    return _with_logprobs(tokens, raw_lp, batch)


def _edits_logits(batch: SamplingBatch) -> bool:
    """Whether a penalty, a logit_bias or a banned id writes into the logits (a copy of
    [batch, vocab] floats is then made first; greedy and plain sampling make none)."""
    return any(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty or p.logit_bias
               for p in batch.params) or any(batch.banned_ids) or bool(batch.grammar_rows)


def _generator(batch: SamplingBatch, row: int) -> torch.Generator | None:
    seed = batch.params[row].seed
    if seed is None:
        return None
    return torch.Generator().manual_seed(draw_seed(seed, len(batch.output_ids[row])))


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition (prompt and output, divide positive / multiply negative logits), then
    frequency and presence (output only): l -= f * count + p * (count > 0)."""
    for row, p in enumerate(batch.params):
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(batch.prompt_ids[row]) | set(batch.output_ids[row])))
            vals = logits[row, seen]
            logits[row, seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                            vals * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and batch.output_ids[row]:
            counts = torch.bincount(torch.tensor(batch.output_ids[row]), minlength=logits.shape[1])
            logits[row] -= p.frequency_penalty * counts[:logits.shape[1]].float()
            logits[row] -= p.presence_penalty * (counts[:logits.shape[1]] > 0).float()
    return logits


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    temps = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    logits = logits / temps
    for row, p in enumerate(params):
        if 0 < p.top_k < logits.shape[1]:
            kth = torch.topk(logits[row], p.top_k).values[-1]
            logits[row][logits[row] < kth] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    top_p = torch.tensor([p.top_p for p in params])
    if (top_p < 1.0).any():
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = (sorted_p.cumsum(dim=-1) - sorted_p) > top_p.unsqueeze(1)
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
    min_p = torch.tensor([p.min_p for p in params])
    if (min_p > 0).any():
        floor = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        probs = torch.where(probs < floor, torch.zeros_like(probs), probs)
    return probs / probs.sum(dim=-1, keepdim=True)


def _with_logprobs(tokens: torch.Tensor, raw_lp: torch.Tensor | None,
                   batch: SamplingBatch) -> SampleResult:
    if raw_lp is None:
        return SampleResult(tokens.tolist(), None, None, None)
    chosen = raw_lp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    k = max((p.logprobs or 0) for p in batch.params)
    top_lp, top_ids = (raw_lp.topk(k, dim=-1) if k else (None, None))
    return SampleResult(tokens.tolist(), chosen, top_ids, top_lp)
