"""The sampler as a pure function: greedy, filters, penalties, seeds, logprobs."""
from __future__ import annotations

import torch

from tessera.config import SamplingParams
from tessera.sampler import SamplingBatch, sample


def batch(params, outputs=None, prompts=None, banned=None) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(params, outputs or [[] for _ in range(n)], prompts or [[0] for _ in range(n)],
                         banned or [()] * n)


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
    a = [sample(logits, batch([sp]), torch.Generator().manual_seed(i)).token_ids[0] for i in range(3)]
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


def test_seeded_draw_depends_only_on_seed_and_output_position():
    """Any replica reproduces a seeded stream: the draw at output position p is the same
    whatever came before it, whatever else is in the batch, whatever the default generator."""
    logits = torch.zeros(1, 1000)                   # uniform: the draw is all noise
    sp = SamplingParams(temperature=1.0, seed=11)
    at = lambda p, outputs=None, g=0: sample(logits, batch([sp], outputs=[outputs or [0] * p]),  # noqa: E731
                                             torch.Generator().manual_seed(g)).token_ids[0]
    assert at(5) == at(5, outputs=[9, 8, 7, 6, 5], g=3)
    draws = [at(p) for p in range(20)]
    assert len(set(draws)) > 15                     # positions draw independently
    other = SamplingParams(temperature=1.0, seed=12)
    assert [sample(logits, batch([other], outputs=[[0] * p])).token_ids[0] for p in range(20)] != draws
    in_batch = sample(logits.expand(3, -1), batch([SamplingParams(temperature=1.0), sp, sp],
                                                  outputs=[[], [0] * 4, [0] * 5]))
    assert in_batch.token_ids[1:] == [at(4), at(5)]


def test_logit_bias_moves_tokens_and_logprobs_stay_raw():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    sp = SamplingParams(temperature=0, logit_bias=((2, 100.0),), logprobs=0)
    out = sample(logits, batch([sp]))
    assert out.token_ids == [2]
    assert torch.allclose(out.logprobs, torch.log_softmax(logits, -1)[0, 2:3])
    banned = SamplingParams(temperature=1.0, logit_bias=((0, -100.0), (1, -100.0)))
    g = torch.Generator().manual_seed(0)
    assert {sample(logits, batch([banned]), g).token_ids[0] for _ in range(50)} == {2}
