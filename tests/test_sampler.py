"""The sampler as a pure function: greedy, filters, penalties, seeds, logprobs."""
from __future__ import annotations

import torch

from tessera.config import SamplingParams
from tessera.sampler import SamplingBatch, sample


def batch(params, outputs=None, prompts=None, gens=None, banned=None) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(params, outputs or [[] for _ in range(n)], prompts or [[0] for _ in range(n)],
                         gens or [None] * n, banned or [()] * n)


def test_greedy_and_pure():
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, 0.0, 1.0]])
    before = logits.clone()
    out = sample(logits, batch([SamplingParams(temperature=0)] * 2))
    assert out.token_ids == [1, 0] and torch.equal(logits, before)


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    best = logits.argmax(-1).tolist()
    g = torch.Generator().manual_seed(1)
    assert sample(logits, batch([SamplingParams(temperature=1.0, top_k=1)] * 4), g).token_ids == best
    assert sample(logits, batch([SamplingParams(temperature=1.0, top_p=1e-6)] * 4), g).token_ids == best
    assert sample(logits, batch([SamplingParams(temperature=1.0, min_p=0.999)] * 4), g).token_ids == best


def test_seed_reproducible_and_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    sp = SamplingParams(temperature=1.0, seed=7)
    a = [sample(logits, batch([sp], gens=[torch.Generator().manual_seed(7)])).token_ids[0] for _ in range(3)]
    assert len(set(a)) == 1
    g = torch.Generator().manual_seed(0)
    draws = [sample(logits, batch([SamplingParams(temperature=1.0)]), g).token_ids[0] for _ in range(3000)]
    freq = [draws.count(i) / len(draws) for i in range(3)]
    assert all(abs(f - p) < 0.04 for f, p in zip(freq, [0.5, 0.3, 0.2])), freq


def test_penalties_and_banned_ids():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    greedy = SamplingParams(temperature=0)
    assert sample(logits, batch([greedy], banned=[(0,)])).token_ids == [1]
    rep = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample(logits, batch([rep], prompts=[[0]])).token_ids == [1]
    freq = SamplingParams(temperature=0, frequency_penalty=0.04)      # 2.0 - 3 * 0.04 < 1.9
    assert sample(logits, batch([freq], outputs=[[0, 0, 0]])).token_ids == [1]
    pres = SamplingParams(temperature=0, presence_penalty=0.05)       # once, whatever the count
    assert sample(logits, batch([pres], outputs=[[0, 0, 0]])).token_ids == [0]
    pres = SamplingParams(temperature=0, presence_penalty=0.2)
    assert sample(logits, batch([pres], outputs=[[0]])).token_ids == [1]


def test_logprobs_of_raw_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    out = sample(logits, batch([SamplingParams(temperature=0, logprobs=2)]))
    ref = torch.log_softmax(logits, -1)[0]
    assert torch.allclose(out.logprobs, ref[2:3])
    assert out.top_ids[0].tolist() == [2, 1]
    assert torch.allclose(out.top_logprobs[0], ref[[2, 1]])
