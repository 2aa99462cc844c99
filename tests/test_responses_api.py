"""The Responses API through what a user runs: `tessera serve` on the default model (two API keys,
responses stored in a real Redis by --jobs-redis) and the official openai client. Greedy outputs
are compared with the chat endpoint's for the same messages, since the Responses API is a
translation of it; streamed events are checked in OpenAI's order; stored responses continue a
conversation, belong to the key that created them and expire; function calls go out as items
and their results come back as items (the shipped chatml_tools template shows tools to SmolLM2);
an agent of OpenAI's Agents SDK runs its tool loop against the server."""
from __future__ import annotations

import json
from typing import Annotated, Literal

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from servers import _process, free_port, redis_url
from tessera import redis_conn
from tessera.entrypoints.gateway.admission import digest
from tessera.responses_store import MemoryResponseStore, StoreConfig, StoredResponse

pytestmark = pytest.mark.e2e
KEY, OTHER_KEY = "sk-responses-a", "sk-responses-b"
MODEL = "smollm2"


@pytest.fixture(scope="module")
def redis():
    with redis_url() as url:
        yield url


@pytest.fixture(scope="module")
def url(redis, tmp_path_factory):
    port = free_port()
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(base + "/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).is_success
        except httpx.HTTPError:
            return False
    with _process(["serve", "--port", str(port), "--worker-port", str(free_port()), "--model", MODEL,
                   "--dtype", "float32", "--threads", "2", "--served-model-name", MODEL, "--kv-cache-gib", "0.05",
                   "--chat-template", "chatml_tools", "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
                   "--jobs-redis", redis, "--files-dir", str(tmp_path_factory.mktemp("files")),
                   "--api-key", KEY, "--api-key", OTHER_KEY], ready, 180):
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def chat_text(client, messages: list[dict], max_tokens: int) -> tuple[str, str]:
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.choices[0].finish_reason


def test_string_input_plain_and_streamed_is_the_chat_answer(client):
    kw = dict(model=MODEL, input="Name three colours.", max_output_tokens=8, temperature=0)
    r = client.responses.create(**kw)
    text, finish = chat_text(client, [{"role": "user", "content": "Name three colours."}], 8)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.output_text == text and text
    assert r.status == ("incomplete" if finish == "length" else "completed")
    message = r.output[0]
    assert message.type == "message" and message.role == "assistant" and message.content[0].annotations == []
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0 and r.max_output_tokens == 8

    events = list(client.responses.create(stream=True, **kw))
    final = events[-1].response
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds == head + ["response.output_text.delta"] * len(deltas) + tail + [f"response.{r.status}"], kinds
    assert "".join(deltas) == final.output_text == text and final.usage.output_tokens == r.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == text


def test_items_and_instructions_are_the_chat_messages(client):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "I have a cat."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Nice!"}]},
             {"role": "user", "content": "What pet do I have?"}]
    r = client.responses.create(model=MODEL, input=items, instructions="Answer in one sentence.",
                                max_output_tokens=8, temperature=0, metadata={"run": "1"})
    text, _ = chat_text(client, [{"role": "system", "content": "Answer in one sentence."},
                                 {"role": "user", "content": "I have a cat."}, {"role": "assistant", "content": "Nice!"},
                                 {"role": "user", "content": "What pet do I have?"}], 8)
    assert r.output_text == text
    assert r.instructions == "Answer in one sentence." and r.metadata == {"run": "1"}


class Answer(BaseModel):
    answer: Literal["yes", "no"]


def test_text_format_json_schema_streamed_through_the_clients_helper(client):
    """responses.stream with a pydantic model: text.format json_schema, and the helper's own checks
    of the event sequence (it needs response.completed, so the output must end by itself)."""
    with client.responses.stream(model=MODEL, input="Is the sky blue? Answer as JSON.", text_format=Answer,
                                 max_output_tokens=30, temperature=1.0) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.text.format.type == "json_schema"
    jsonschema.validate(json.loads(final.output_text), Answer.model_json_schema())
    assert isinstance(final.output_parsed, Answer)
    parsed = client.responses.parse(model=MODEL, input="Is grass green? Answer as JSON.", text_format=Answer,
                                    max_output_tokens=30, temperature=0)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Answer)


def test_max_output_tokens_makes_it_incomplete(client):
    r = client.responses.create(model=MODEL, input="Write a long story about the sea.", max_output_tokens=2,
                                temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2 and r.output[0].status == "incomplete"


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model=MODEL, input="My name is Ada. Greet me.", max_output_tokens=8,
                                    temperature=0)
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    text, _ = chat_text(client, [{"role": "user", "content": "My name is Ada. Greet me."},
                                 {"role": "assistant", "content": first.output_text},
                                 {"role": "user", "content": "What is my name?"}], 8)
    assert second.output_text == text


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city now.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}


def test_a_function_call_and_its_result_over_two_turns(client):
    kw = dict(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER], max_output_tokens=40,
              tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    first = client.responses.create(**kw)
    assert first.status == "completed" and [item.type for item in first.output] == ["function_call"]
    call = first.output[0]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])

    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * len(fragments),
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert "".join(fragments) == events[-1].response.output[0].arguments == call.arguments

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "22 degrees, sunny"}
    second = client.responses.create(model=MODEL, input=[result], previous_response_id=first.id, tools=[WEATHER],
                                     tool_choice="none", max_output_tokens=8, temperature=0)
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0, tool_choice="none",
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        messages=[{"role": "user", "content": "What is the weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": call.call_id, "type": "function",
                       "function": {"name": call.name, "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "22 degrees, sunny"}])
    assert second.output_text == chat.choices[0].message.content and second.output_text


def test_stored_responses_belong_to_their_key_and_expire(client, url, redis):
    r = client.responses.create(model=MODEL, input="Hi.", max_output_tokens=4, temperature=0)
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    ttl = redis_conn.connect(redis, blocking=True).ttl(f"tessera:response:{digest(KEY)}:{r.id}")
    assert 0 < ttl <= StoreConfig().ttl_s
    other = openai.OpenAI(base_url=url + "/v1", api_key=OTHER_KEY, max_retries=0, timeout=60)
    for call in (lambda: other.responses.retrieve(r.id), lambda: other.responses.delete(r.id),
                 lambda: other.responses.create(model=MODEL, input="x", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    unstored = client.responses.create(model=MODEL, input="Hi.", max_output_tokens=2, store=False)
    deleted = httpx.delete(f"{url}/v1/responses/{r.id}", headers={"Authorization": f"Bearer {KEY}"})
    assert deleted.json() == {"id": r.id, "object": "response", "deleted": True}
    for gone in (r.id, unstored.id, "resp_0123", "../etc"):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(gone)


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "web_search_preview"}]}, "tools[0].type"),
    ({"background": True}, "background"),
    ({"reasoning": {"summary": "auto"}}, "reasoning"),
    ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": "nope"}}}, "text"),
])
def test_bad_input_is_a_400_naming_the_param(url, body, param):
    r = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "input": "hi", **body},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error", r.json()


def test_memory_store_is_bounded_and_per_owner():
    import asyncio

    def record(i: int) -> StoredResponse:
        return StoredResponse({"id": f"resp_{i}", "output": "x" * 100}, [])

    async def run() -> None:
        store = MemoryResponseStore(StoreConfig(max_bytes=3 * len(record(0).dumps())))
        for i in range(3):
            await store.put("a", record(i))
        assert await store.get("a", "resp_0") is not None    # now the most recently used
        await store.put("a", record(3))
        assert await store.get("a", "resp_1") is None and await store.get("a", "resp_0") is not None
        assert await store.get("b", "resp_0") is None and not await store.delete("b", "resp_0")
        assert await store.delete("a", "resp_0") and store.bytes == 2 * len(record(0).dumps())
    asyncio.run(run())


# --- hostile input, in process against the twin worker (tiny random model): never a 500 ----------

@pytest.fixture(scope="module")
def app(tiny_models):
    from tessera.async_engine import AsyncEngine
    from tessera.config import CacheConfig, EngineConfig
    from tessera.engine import Engine
    from tessera.entrypoints.gateway.app import create_app
    from tessera.local_client import LocalWorkerClient
    engine = AsyncEngine(Engine(EngineConfig(model=tiny_models["llama"], dtype="float32", max_model_len=96,
                                             cache=CacheConfig(block_size=4, num_blocks=256))))
    yield create_app(LocalWorkerClient(engine), "tiny")
    engine.shutdown()


def send(app, method: str, path: str, body: bytes | None = None) -> httpx.Response:
    import asyncio

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=60) as c:
            return await c.request(method, path, content=body, headers={"content-type": "application/json"})
    return asyncio.run(main())


wild = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                 st.text(max_size=12), st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=4),
                                                                                       st.integers(), max_size=2))
text = st.one_of(st.text(max_size=20), st.sampled_from(["a\ud800b", "resp_0", "x" * 3000]))
parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image"]) | wild},
                                       optional={"text": text | wild}), max_size=2)
items = st.lists(st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning"]) | wild,
    "role": st.sampled_from(["user", "system", "developer", "assistant", "tool"]) | wild,
    "content": text | parts | wild, "call_id": text | wild, "name": text | wild, "arguments": text | wild,
    "output": text | parts | wild}), max_size=3)
formats = st.one_of(wild, st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"]) | wild},
                                                optional={"name": text | wild, "schema": wild, "strict": wild}))
tools = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"]) | wild},
                                       optional={"name": text | wild, "parameters": wild, "strict": wild}), max_size=2)
responses_bodies = st.fixed_dictionaries({"model": st.sampled_from(["tiny", "other"]), "input": text | items | wild},
                                         optional={
    "instructions": text | wild, "tools": tools | wild, "text": st.fixed_dictionaries({"format": formats}) | wild,
    "tool_choice": st.sampled_from(["none", "auto", "required"]) | st.fixed_dictionaries(
        {"type": st.just("function") | wild, "name": text | wild}) | wild,
    "max_output_tokens": st.integers(-1, 6) | wild, "temperature": st.floats(-1, 3) | wild, "top_p": wild,
    "stream": st.booleans(), "store": st.booleans() | wild, "previous_response_id": text | wild,
    "metadata": st.dictionaries(text, text, max_size=3) | wild, "reasoning": wild, "background": wild,
    "include": wild, "truncation": wild, "parallel_tool_calls": wild})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(body=responses_bodies)
def test_hostile_bodies_are_refused_in_openais_shape_never_a_500(app, body):
    r = send(app, "POST", "/v1/responses", json.dumps(body).encode())
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert isinstance(r.json()["error"]["message"], str)
    elif body.get("stream"):
        last = json.loads(r.text.rstrip().rsplit("data: ", 1)[1])
        assert last["type"] in ("response.completed", "response.incomplete", "response.failed"), last
    else:
        assert r.json()["object"] == "response"


def test_both_stores_satisfy_one_protocol(tmp_path):
    """mypy: each store used as the ResponseStore the routes hold; a store whose get() lacks
    the owner (so could hand any caller any response) must be refused."""
    import pathlib
    import subprocess
    import sys
    import textwrap
    pytest.importorskip("mypy")
    (tmp_path / "uses.py").write_text(textwrap.dedent("""
        from tessera.responses_store import MemoryResponseStore, RedisResponseStore, ResponseStore, StoredResponse

        def stores(memory: MemoryResponseStore, redis: RedisResponseStore) -> list[ResponseStore]:
            return [memory, redis]

        class Ownerless(MemoryResponseStore):
            async def get(self, response_id: str) -> StoredResponse | None:  # type: ignore[override]
                return None

        def ownerless(store: Ownerless) -> ResponseStore:
            return store
    """))
    services = pathlib.Path(__file__).resolve().parents[1] / "services"
    (tmp_path / "mypy.ini").write_text(f"[mypy]\nmypy_path = {services}\nfollow_imports = silent\n"
                                       "ignore_missing_imports = True\n")
    out = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--no-incremental", "uses.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and errors[0].startswith("uses.py:12:") and '"Ownerless"' in errors[0], out.stdout


def test_tokenize_needs_a_key_where_the_gateway_has_keys(url):
    assert httpx.post(url + "/tokenize", json={"prompt": "hi"}).status_code == 401
    r = httpx.post(url + "/tokenize", json={"prompt": "hi"}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["count"] >= 1


class Forecast(BaseModel):
    summary: str = Field(max_length=60)


def test_an_agent_of_the_openai_agents_sdk_calls_its_tool(url):
    """The Agents SDK (openai-agents), as people build agents on the openai client: its
    Responses-API model against this server, a function tool it must call first (the SDK then
    resets tool_choice), its result fed back, a typed final answer (text.format on every turn,
    the forced one included, as the SDK sends it)."""
    agents = pytest.importorskip("agents")
    import asyncio

    agents.set_tracing_disabled(True)        # its traces would go to OpenAI's servers
    asked: list[str] = []

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(max_length=30)]) -> str:
        """The weather in a city now."""
        asked.append(city)
        return f"Sunny, 22 C in {city}."

    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120))
    agent = agents.Agent(name="weather", instructions="Answer in one short sentence.", tools=[get_weather],
                         output_type=Forecast, model=model,
                         # one call per turn: a list of forced calls is ended only by the model, and
                         # this small one goes on repeating the same call
                         model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                             temperature=0, max_tokens=120))
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert asked and all(isinstance(city, str) for city in asked)
    assert isinstance(result.final_output, Forecast)
