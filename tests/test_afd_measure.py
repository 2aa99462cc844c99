"""The fixed-batch decode window that `bench afd` and `tessera profile` time (disagg.measure),
on the monolithic engine with a tiny random MoE: it counts the tokens emitted, and a window in
which a request is preempted or finishes fails instead of being timed. No timing is checked."""
from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass

import pytest

from tessera.disagg.measure import FixedBatchError, Window, engine_config, timed_decode
from tessera.engine import Engine

MOE = "random:mixtral"
SERVICES = pathlib.Path(__file__).resolve().parent.parent / "services" / "tessera"


@pytest.fixture(scope="module")
def make_engine():
    """Engines for windows of one model, loaded once."""
    import torch

    from tessera.models.loader import load_model
    from tessera.tokenizer import load_tokenizer
    model, _ = load_model(MOE, torch.float32)
    tokenizer = load_tokenizer(MOE)
    return lambda window: Engine(engine_config(MOE, window, None), model, tokenizer)


def test_a_sized_window_emits_one_token_per_request_and_step(make_engine):
    window = Window(batch=6, prompt_len=5, steps=7)
    engine = make_engine(window)
    elapsed, emitted, _, _ = timed_decode(engine, window)
    assert emitted == 6 * 7 and elapsed > 0
    assert not engine.has_unfinished     # the requests are aborted after the window


def test_the_bench_batch_fits_its_cache_with_prefill_in_chunks():
    """B = 256 prompts of 32 tokens take several chunked-prefill steps, during which the first
    requests already decode: max_tokens and the cache allow for that."""
    window = Window(batch=256, prompt_len=32, steps=48)
    assert window.token_budget > window.batch
    assert window.num_blocks * 16 >= window.batch * (window.prompt_len + window.max_tokens)


@dataclass(frozen=True)
class SmallCache(Window):
    """One block per request and one spare: the second request to outgrow its first block
    inside the window preempts another."""
    @property
    def num_blocks(self) -> int:
        return self.batch + 1


@dataclass(frozen=True)
class ShortRequests(Window):
    @property
    def max_tokens(self) -> int:
        return self.warmup + 4


@pytest.mark.parametrize("window,error", [(SmallCache(batch=4, prompt_len=4, steps=12), "preemption"),
                                          (ShortRequests(batch=4, prompt_len=4, steps=12), "finished")])
def test_a_window_that_is_not_fixed_batch_decode_fails(make_engine, window, error):
    engine = make_engine(window)
    with pytest.raises(FixedBatchError, match=error):
        timed_decode(engine, window)


def test_runtime_code_does_not_import_benchmarks():
    """tessera.bench may import the runtime (disagg.measure, profile); only the command line
    imports tessera.bench."""
    offenders = []
    for path in SERVICES.rglob("*.py"):
        rel = path.relative_to(SERVICES)
        if rel.parts[0] == "bench" or rel.name == "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            offenders += [f"{rel}: {n}" for n in names if n == "tessera.bench" or n.startswith("tessera.bench.")]
    assert not offenders
