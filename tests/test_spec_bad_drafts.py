"""A draft whose tokens the target's vocabulary lacks (what a draft client that does not know
the vocabulary size passes on) is dropped by the target, never fails its step."""
from __future__ import annotations

import pytest
import torch

from test_spec import PROMPTS, engine
from tessera.config import SpeculativeConfig
from tessera.engine import Engine
from tessera.models.loader import load_model
from tessera.spec.proposer import SerialProposer
from tessera.spec.tree import Draft


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models["llama"]


class OutOfVocabProposer(SerialProposer):
    """A draft worker whose every other draft carries a token id the target's vocabulary lacks
    (what a draft client that does not know the vocabulary size passes on)."""

    def __init__(self, bad: int, *args) -> None:
        super().__init__(*args)
        self.bad, self.rounds, self.bad_drafts = bad, 0, 0

    def propose(self, request_id, token_ids, num_new, size):
        draft = super().propose(request_id, token_ids, num_new, size)
        self.rounds += 1
        if draft is None or self.rounds % 2:
            return draft
        self.bad_drafts += 1
        return Draft(draft.tokens[:-1] + (self.bad,), draft.parents)


@pytest.mark.parametrize("bad", [-1, -2**31, "vocab", 2**31 - 1])
def test_a_draft_token_outside_the_vocabulary_drops_only_that_draft(llama, bad):
    """Through the HTTP API, two requests speculating in one batch: a draft with a bad token
    id is dropped (that round decodes plainly), never fails the step: both get 200 and the
    text of plain decoding, and the good drafts in between are still accepted."""
    import asyncio

    import httpx

    from tessera.async_engine import AsyncEngine
    from tessera.entrypoints.gateway.app import create_app
    from tessera.local_client import LocalWorkerClient
    model = load_model(llama, torch.float32)[0]
    bad = model.config.vocab_size if bad == "vocab" else bad
    cfg = SpeculativeConfig(draft="self:2", disable_batch_size=2)
    proposer = OutOfVocabProposer(bad, model, range(len(model.layers)), cfg, 2048)
    body = {"model": "tiny", "max_tokens": 16, "temperature": 0, "ignore_eos": True}

    def complete(e: Engine) -> list[str]:
        async_engine = AsyncEngine(e)
        app = create_app(LocalWorkerClient(async_engine), "tiny")

        async def main():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
                return await asyncio.wait_for(asyncio.gather(
                    *(c.post("/v1/completions", json=dict(body, prompt=p)) for p in PROMPTS[:2])), 60)
        try:
            responses = asyncio.run(main())
        finally:
            async_engine.shutdown()
        assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
        return [r.json()["choices"][0]["text"] for r in responses]
    spec = engine(llama, "self:2", proposer=proposer, disable_batch_size=2)
    assert complete(spec) == complete(engine(llama))
    assert proposer.bad_drafts > 0 and spec.spec_stats.accepted_tokens > 0
