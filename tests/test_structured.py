"""Structured outputs in the engine, on the default model in float32: every finished output
matches its grammar (checked by jsonschema / re, not by the grammar library; sampled JSON over
many seeds is test_structured_api's, through `tessera serve`); a constrained row
changes nothing for the other rows of its batch; a seeded constrained request gives the same
tokens alone, in a batch, under speculative verification and after a failover (the grammar
state rebuilt from the tokens already generated)."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tessera.config import CacheConfig, ConfigError, EngineConfig, SamplingParams, SpeculativeConfig, StructuredOutput
from tessera.engine import Engine
from tessera.request import Resume
from tessera.spec.tree import Draft
from tessera.tokenizer import user_message_ids

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"anyOf": [{"type": "string", "pattern": "^[a-z.]{1,16}@[a-z]{1,12}\\.(com|org)$"}, {"type": "null"}]},
    "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "minItems": 1, "maxItems": 3},
    "address": {"$ref": "#/$defs/address"}},
    "required": ["name", "age", "email", "tags", "address"], "additionalProperties": False,
    "$defs": {"address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                          "required": ["city", "zip"], "additionalProperties": False}}}
JSON = StructuredOutput("json", json.dumps(PERSON))


@pytest.fixture(scope="module")
def eng():
    return Engine(EngineConfig(model="smollm2", dtype="float32", cache=CacheConfig(num_blocks=256)))


@pytest.fixture(scope="module")
def prompt(eng):
    return user_message_ids(eng.tokenizer, "Describe one user of our website as JSON.")


def run(eng, prompt, sp, n=1, resume=None):
    """(token ids, finish_reason) per request (sp: one SamplingParams for n requests, or a
    list, one each), all in one batch, stepping the engine to completion."""
    params = sp if isinstance(sp, list) else [sp] * n
    ids = [eng.add_request(prompt, p, resume=resume) for p in params]
    tokens, finish = {i: [] for i in ids}, {}
    while eng.has_unfinished:
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finish[out.request_id] = out.finish_reason
    return [(tokens[i], finish[i]) for i in ids]


def text(eng, ids):
    return eng.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("spec, check", [
    (StructuredOutput("regex", r"[0-9]{3}-[A-Z]{2}"), lambda s: re.fullmatch(r"[0-9]{3}-[A-Z]{2}", s)),
    (StructuredOutput("choice", json.dumps(["yes", "no", "a \"maybe\""])), lambda s: s in ("yes", "no", 'a "maybe"')),
    (StructuredOutput("grammar", 'start: "sum(" NUM "," NUM ")"\nNUM: /[1-9][0-9]?/'),
     lambda s: re.fullmatch(r"sum\([1-9][0-9]?,[1-9][0-9]?\)", s)),
])
def test_each_kind_is_followed(eng, prompt, spec, check):
    params = [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=100, structured=spec) for i in range(3)]
    for ids, finish in run(eng, prompt, params):
        assert finish == "stop" and check(text(eng, ids)), text(eng, ids)


def test_mixed_batch_rows_are_each_as_alone(eng, prompt):
    """Two grammars and an unconstrained row in one batch: each row's tokens equal its own run
    alone (seeded), so a mask reaches only its own row."""
    specs = [JSON, None, StructuredOutput("regex", "[a-z ]{5,40}")]
    params = [SamplingParams(temperature=0.8, seed=11 + i, max_tokens=24, structured=s) for i, s in enumerate(specs)]
    alone = [run(eng, prompt, sp)[0] for sp in params]
    ids = [eng.add_request(prompt, sp) for sp in params]
    got = {i: [] for i in ids}
    while eng.has_unfinished:
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
    assert [got[i] for i in ids] == [a[0] for a in alone]


def test_failover_resumes_the_grammar_from_the_tokens_so_far(eng, prompt):
    """A request cut after 9 tokens and resumed elsewhere (Resume carries its output) continues
    with the same tokens as the uninterrupted run: the matcher replays the 9 tokens first."""
    sp = SamplingParams(temperature=1.0, seed=5, max_tokens=30, structured=JSON)
    (whole, finish), = run(eng, prompt, sp)
    (rest, finish2), = run(eng, prompt, sp, resume=Resume(output_token_ids=tuple(whole[:9])))
    assert whole[:9] + rest == whole and finish2 == finish


class Oracle:
    """A drafter that knows the plain output: it proposes the next three tokens of it as a chain,
    beside a wrong first token, so that verification accepts along a path whose every node the
    grammar masks with its own state (a drafter of the model itself rarely agrees with a
    grammar-constrained target on this small model)."""

    def __init__(self, prompt_len: int, expected: list[int], wrong: int) -> None:
        self.prompt_len, self.expected, self.wrong = prompt_len, expected, wrong

    def propose(self, request_id, token_ids, num_new, size):
        done = list(token_ids[self.prompt_len:])
        nxt = self.expected[len(done):len(done) + 3]
        if self.expected[:len(done)] != done or not nxt:
            return None
        return Draft((self.wrong, *nxt), (0, 0, *range(2, len(nxt) + 1)))

    def finish(self, request_id):
        pass


def test_speculative_verification_keeps_the_constrained_output(eng, prompt):
    """Each tree node is sampled with the matcher along its own path: speculative output equals
    plain output for a constrained request, greedy and seeded, and draft tokens are accepted."""
    wrong = eng.tokenizer.encode("!", add_special_tokens=False)[0]
    for sp in (SamplingParams(temperature=0, max_tokens=30, structured=JSON),
               SamplingParams(temperature=1.0, seed=3, max_tokens=30, structured=JSON)):
        (expected, finish), = run(eng, prompt, sp)
        oracle = Oracle(len(prompt), expected, wrong)
        spec = Engine(EngineConfig(model="smollm2", dtype="float32", cache=CacheConfig(num_blocks=64), enforce_eager=True,
                                   speculative=SpeculativeConfig(draft="ngram")), tokenizer=eng.tokenizer, proposer=oracle)
        assert run(spec, prompt, sp) == [(expected, finish)]
        assert spec.spec_stats.accepted_tokens >= len(expected) // 2


def test_max_tokens_inside_the_structure_is_length(eng, prompt):
    (ids, finish), = run(eng, prompt, SamplingParams(temperature=0, max_tokens=5, structured=JSON))
    assert finish == "length" and len(ids) == 5 and text(eng, ids).startswith("{")


@pytest.mark.parametrize("spec, message", [
    (StructuredOutput("json", json.dumps({"type": "object", "not": {"required": ["a"]}})), 'Unimplemented keys: ["not"]'),
    (StructuredOutput("json", "{nope"), "not valid JSON"),
    (StructuredOutput("regex", "(["), "regex cannot be used"),
    (StructuredOutput("grammar", "start: undefined_rule"), "grammar cannot be used"),
    (StructuredOutput("choice", "[]"), "non-empty list"),
    (StructuredOutput("json", json.dumps({"enum": ["x" * 70_000]})), "at most 65536 are allowed"),
])
def test_a_grammar_that_cannot_be_used_is_a_config_error_naming_the_param(eng, prompt, spec, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        eng.add_request(prompt, SamplingParams(structured=spec))
    assert e.value.param == "response_format" and not eng.has_unfinished
