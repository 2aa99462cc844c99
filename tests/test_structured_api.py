"""Structured outputs through what a user runs: `tessera serve` on the default model and the
official openai client (its parse() helper with a pydantic model, response_format json_schema,
vLLM's structured_outputs extension), streamed = not streamed, and bad schemas as 400s that
name the field while a request beside them completes."""
from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from servers import tessera_serve
from test_structured import PERSON

pytestmark = pytest.mark.e2e


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population_millions: float = Field(ge=0, le=50)
    landmarks: list[str] = Field(min_length=1, max_length=3)


@pytest.fixture(scope="module")
def url():
    with tessera_serve("--model", "smollm2", "--dtype", "float32", "--threads", "2",
                       "--served-model-name", "smollm2") as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(model="smollm2", messages=ask("Tell me about Paris as JSON."),
                                      response_format=City, temperature=0, max_tokens=200)
    assert r.choices[0].finish_reason == "stop"
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and 1 <= len(city.landmarks) <= 3


def test_sampled_json_validates_against_its_schema(client):
    """Temperature 1, sixteen seeds (n=16: each choice draws from its own): each output that ends
    with "stop" is valid JSON that the jsonschema package validates (nested objects, $ref/$defs,
    anyOf with null, an enum array with min/max items, patterns, bounded numbers and strings);
    at least 90% end with "stop" within 400 tokens."""
    r = client.with_options(timeout=600).chat.completions.create(     # 16 x up to 400 tokens
        model="smollm2", messages=ask("Describe one user of our website as JSON."), n=16, seed=0,
        temperature=1.0, max_tokens=400,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    stopped = [c.message.content for c in r.choices if c.finish_reason == "stop"]
    assert len(r.choices) == 16 and len(stopped) >= 0.9 * 16
    for text in stopped:
        jsonschema.validate(json.loads(text), PERSON)


def test_json_schema_streamed_equals_not_streamed(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
              "required": ["answer", "confidence"], "additionalProperties": False}
    kw = dict(model="smollm2", messages=ask("Is the sky blue?"), temperature=1.0, seed=4, max_tokens=60,
              response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}})
    whole = client.chat.completions.create(**kw)
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    assert "".join(pieces) == whole.choices[0].message.content
    jsonschema.validate(json.loads(whole.choices[0].message.content), schema)


def test_vllm_structured_outputs_extension(client):
    r = client.completions.create(model="smollm2", prompt="A product code:", max_tokens=20, temperature=1.0, seed=1,
                                  extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{4}"}})
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{4}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model="smollm2", messages=ask("Pick a colour."), max_tokens=10,
                                       extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert r.choices[0].message.content in ("red", "green", "blue")


@pytest.mark.parametrize("response_format, message", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}}},
     'Unimplemented keys: ["not"]'),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["x" * 70_000]}}}, "at most 65536"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": "nope"}}, "must be an object"),
    ({"type": "xml"}, "is not one of text, json_object, json_schema"),
])
def test_a_bad_schema_is_a_400_naming_response_format_and_harms_no_one(url, response_format, message):
    async def both():
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        good = asyncio.create_task(c.chat.completions.create(
            model="smollm2", messages=ask("Count to five."), max_tokens=24, temperature=0,
            response_format={"type": "json_object"}))
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model="smollm2", messages=ask("hi"), max_tokens=8,
                                            response_format=response_format)
        return e.value, await good
    error, good = asyncio.run(both())
    assert error.body["param"] == "response_format" and message in error.body["message"], error.body
    assert good.choices[0].finish_reason in ("stop", "length") and good.choices[0].message.content.startswith("{")
