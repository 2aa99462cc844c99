"""A request whose token fails after sampling (detokenizing, stop-string or stop-token
matching, appending the token, finishing it) fails alone: it gets a 500, and the requests
batched with it (before and after it in the batch, one that finishes in the same step
included) get exactly what they get in a run without the fault: same text, logprobs,
finish_reason and usage. Each row of a step is postprocessed exactly once."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from tessera.async_engine import AsyncEngine
from tessera.config import CacheConfig, EngineConfig, SchedulerConfig
from tessera.detokenizer import IncrementalDetokenizer
from tessera.engine import Engine
from tessera.entrypoints.gateway.app import create_app
from tessera.local_client import LocalWorkerClient
from tessera.request import Request

MARK = "\u2603\u2603"        # a stop string that marks the request the fault is injected into
FAIL_AT = 3                  # its third output token fails
OK = [dict(max_tokens=n, temperature=0.7, seed=10 + i, logprobs=2) for i, n in enumerate((12, FAIL_AT, 1, 20))]
MARKED = dict(max_tokens=FAIL_AT, temperature=0.7, seed=3, logprobs=2, stop=[MARK])


@pytest.fixture(scope="module")
def engine(tiny_models):
    # every request of a test is prefilled in one first step, in the same batch each run, and
    # the same way (a prefix cache hit would compute the prompt in other pieces: other roundings)
    cfg = EngineConfig(model=tiny_models["llama"], dtype="float32",
                       cache=CacheConfig(block_size=4, num_blocks=64, enable_prefix_caching=False),
                       scheduler=SchedulerConfig(max_num_seqs=len(OK) + 1, max_queue_delay_ms=5000))
    engine = AsyncEngine(Engine(cfg))
    yield engine
    engine.shutdown()


def _marked(obj) -> bool:
    stop = obj.stop if isinstance(obj, IncrementalDetokenizer) else obj.sampling.stop
    return MARK in stop


def _fails_at_token(method, count):
    """method, raising on the marked request's FAIL_AT-th call of count(self) (its tokens)."""
    def faulty(self, *args, **kwargs):
        if _marked(self) and count(self) >= FAIL_AT:
            raise RuntimeError("injected postprocessing fault")
        return method(self, *args, **kwargs)
    return faulty


_calls: dict[int, int] = {}


def _nth_call(self) -> int:
    _calls[id(self)] = _calls.get(id(self), 0) + 1
    return _calls[id(self)]


FAULTS = {   # where the fault is injected: (class, method, how far the request is at the call)
    "detokenize": (IncrementalDetokenizer, "append", _nth_call),
    "stop_string": (IncrementalDetokenizer, "_check_stop", lambda d: FAIL_AT),   # its first text
    "text_delta": (IncrementalDetokenizer, "delta", _nth_call),
    "append_token": (Request, "append_output", lambda r: r.num_output_tokens + 1),
    "stop_token": (Request, "check_stop_token", lambda r: r.num_output_tokens),
    "finish": (Request, "timings", lambda r: r.num_output_tokens),
}


def _send(engine) -> list[httpx.Response]:
    app = create_app(LocalWorkerClient(engine), "tiny")
    bodies = [dict(extra, model="tiny", prompt=f"row {i} of the batch", ignore_eos=True)
              for i, extra in enumerate(OK[:2] + [MARKED] + OK[2:])]

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw",
                                     timeout=120) as c:
            # the in-process transport has no timeout of its own: a request that never ends fails here
            return await asyncio.wait_for(asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies)), 60)
    responses = asyncio.run(main())
    return responses[:2] + responses[3:] + [responses[2]]


def _view(r: httpx.Response):
    body = r.json()
    return [(c["text"], c["logprobs"], c["finish_reason"]) for c in body["choices"]], body["usage"]


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_failing_row_fails_alone(engine, monkeypatch, fault):
    *baseline, marked = _send(engine)
    assert all(r.status_code == 200 for r in baseline + [marked]), [r.text for r in baseline + [marked]]
    assert marked.json()["usage"]["completion_tokens"] == FAIL_AT
    cls, name, count = FAULTS[fault]
    _calls.clear()
    monkeypatch.setattr(cls, name, _fails_at_token(getattr(cls, name), count))
    *others, failed = _send(engine)
    monkeypatch.undo()
    assert failed.status_code == 500, failed.text
    assert failed.json()["error"]["code"] == "internal_error"
    assert [r.status_code for r in others] == [200] * len(OK), [r.text for r in others]
    assert [_view(r) for r in others] == [_view(r) for r in baseline]
    assert engine.alive and engine.engine.kv.num_free_blocks == engine.engine.kv.num_blocks
