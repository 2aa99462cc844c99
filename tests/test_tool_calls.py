"""Tool calling: the --tool-call-parser formats read from real-format strings (streamed in pieces of
every size = read whole), the list of forced calls read as it arrives, and, through `tessera serve`
on the default model with the shipped chatml_tools template and the openai client, forced calls
(required, named) whose arguments validate against their function, streamed = not streamed, a
history with calls and tool results, "auto" read by the hermes parser, and refusals as 400s."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from servers import tessera_serve
from tessera.chat_config import TOOL_CALL_PARSERS, ChatConfig
from tessera.config import ConfigError
from tessera.openai_api.errors import APIError
from tessera.openai_api.protocol import ChatCompletionRequest
from tessera.openai_api.tool_parsers import PARSERS
from tessera.openai_api.tool_stream import ToolStream, message
from tessera.openai_api.tools import ToolPlan, required_schema, tool_plan

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
                   "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def streamed(plan: ToolPlan, text: str, size: int) -> tuple[str, list[dict], str | None]:
    """(content, calls, finish reason) of `text` fed in pieces of `size`, deltas put together as
    the openai client does."""
    stream, content, calls, finish = ToolStream(plan), "", [], None
    for i in range(0, len(text), size):
        delta, finish = stream.feed(text[i:i + size], "stop" if i + size >= len(text) else None)
        content += delta.get("content", "")
        for entry in delta.get("tool_calls", ()):
            if "id" in entry:
                assert entry["index"] == len(calls) and entry["type"] == "function"
                calls.append({"name": entry["function"]["name"], "arguments": entry["function"]["arguments"]})
            else:
                calls[entry["index"]]["arguments"] += entry["function"]["arguments"]
    return content, calls, finish


def whole(plan: ToolPlan, text: str) -> tuple[str | None, list[dict], str | None]:
    body, finish = message(plan, text, "stop")
    return body["content"], [c["function"] for c in body.get("tool_calls", ())], finish


def assert_streams_alike(plan: ToolPlan, text: str) -> None:
    content, calls, finish = whole(plan, text)
    for size in (1, 2, 5, len(text)):
        assert streamed(plan, text, size) == (content or "", calls, finish), size


HERMES_TWO = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')


@pytest.mark.parametrize("parser, text, content, calls", [
    ("hermes", HERMES_TWO, "Let me check.",
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}', None,   # ended before </tool_call>
     [("get_time", {"zone": "UTC"})]),
    ("hermes", 'Sure <tool_call>{"name": "get_time", "arguments": {"zone": </tool_call>',
     'Sure <tool_call>{"name": "get_time", "arguments": {"zone": </tool_call>', []),
    ("hermes", "No tools needed: 3 < 4.", "No tools needed: 3 < 4.", []),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
     '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}', None,
     [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Rome", "unit": "celsius"})]),
    ("llama3_json", ' {"name": "get_time", "arguments": {"zone": "UTC"}}', None, [("get_time", {"zone": "UTC"})]),
    ("llama3_json", 'It is {"zone": 1} or so', 'It is {"zone": 1} or so', []),
    ("llama3_json", '{"name": "get_time", "parameters": {"zone"', '{"name": "get_time", "parameters": {"zone"', []),
    ("mistral", 'Checking.[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}, '
     '{"name": "get_time", "arguments": {"zone": "CET"}}]', "Checking.",
     [("get_time", {"zone": "UTC"}), ("get_time", {"zone": "CET"})]),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": ', '[TOOL_CALLS][{"name": "get_time", "arguments": ', []),
    ("mistral", '[{"name": "get_time", "arguments": {"zone": "UTC"}}]', None,     # [TOOL_CALLS] dropped as special
     [("get_time", {"zone": "UTC"})]),
    ("mistral", "[1] says no.", "[1] says no.", []),
    # JSON answers, not calls: no arguments, or a name no tool has
    ("llama3_json", '{"name": "Paris", "population": 2100000}', '{"name": "Paris", "population": 2100000}', []),
    ("mistral", '[{"name": "Alice"}, {"name": "Bob"}]', '[{"name": "Alice"}, {"name": "Bob"}]', []),
    ("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', []),
])
def test_parser_reads_its_format(parser, text, content, calls):
    plan = ToolPlan("auto", parser, names=("get_weather", "get_time"))
    got_content, got_calls, finish = whole(plan, text)
    assert got_content == content
    assert [(c["name"], json.loads(c["arguments"])) for c in got_calls] == calls
    assert finish == ("tool_calls" if calls else "stop")
    assert_streams_alike(plan, text)


def test_parsers_are_the_ones_the_flag_offers():
    assert sorted(PARSERS) == sorted(TOOL_CALL_PARSERS)


def test_mistral_ids_are_nine_letters_and_digits_as_its_template_requires():
    body, _ = message(ToolPlan("auto", "mistral"), '[TOOL_CALLS][{"name": "f", "arguments": {}}]', "stop")
    assert re.fullmatch(r"[A-Za-z0-9]{9}", body["tool_calls"][0]["id"])
    body, _ = message(ToolPlan("auto", "hermes"), '<tool_call>{"name": "f", "arguments": {}}</tool_call>', "stop")
    assert re.fullmatch(r"call_[0-9a-f]{24}", body["tool_calls"][0]["id"])


def test_only_a_possible_start_of_a_call_is_held_back():
    stream = ToolStream(ToolPlan("auto", "hermes"))
    assert stream.feed("3 < 4 and <tool", None)[0] == {"content": "3 < 4 and"}
    assert stream.feed("s> too", None)[0] == {"content": " <tools> too"}
    assert stream.feed(" <tool_call>{", None)[0] == {}        # inside a call: held to the end
    assert stream.feed('"name": "f", "argu', "length") == ({"content": ' <tool_call>{"name": "f", "argu'}, "length")


def test_parallel_tool_calls_false_keeps_the_first_call():
    _, calls, _ = whole(ToolPlan("auto", "hermes", parallel=False), HERMES_TWO)
    assert [c["name"] for c in calls] == ["get_weather"]


def test_the_forced_list_is_read_as_it_arrives_whatever_the_key_order():
    text = ('[{"name":"get_weather","parameters":{"city":"Pa\\"ris}","unit":"celsius"}},'
            '{"parameters":{"zone":"[UTC]"},"name":"get_time"}]')
    plan = ToolPlan("required")
    _, calls, finish = whole(plan, text)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": 'Pa"ris}', "unit": "celsius"}), ("get_time", {"zone": "[UTC]"})]
    assert finish == "tool_calls"
    assert_streams_alike(plan, text)


def test_required_schema_takes_one_call_per_function_and_lifts_defs():
    city = {"type": "function", "function": {"name": "find", "parameters": {
        "type": "object", "properties": {"place": {"$ref": "#/$defs/place"}}, "required": ["place"],
        "$defs": {"place": {"type": "string", "enum": ["Paris", "Rome"]}}}}}
    tools = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=[WEATHER, city]).tools
    one = required_schema(tools, parallel=False)
    good = {"name": "find", "parameters": {"place": "Rome"}}
    jsonschema.validate([good], one)
    for bad in ([], [good, good], [{"name": "find", "parameters": {"place": "Oslo"}}],
                [{"name": "get_weather", "parameters": {"place": "Rome"}}], [{"name": "nope", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, one)
    jsonschema.validate([good, good], required_schema(tools, parallel=True))


def test_plan_refusals_name_the_field():
    def plan(parser="", **fields):
        return tool_plan(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], **fields), parser)
    for fields, parser, param in (
            ({"tools": [WEATHER]}, "", "tools"),                    # auto by default, and no parser
            ({"tools": [WEATHER], "tool_choice": "auto"}, "", "tool_choice"),
            ({"tool_choice": "required"}, "hermes", "tool_choice"),  # no tools
            ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "", "tool_choice")):
        with pytest.raises(APIError) as e:
            plan(parser, **fields)
        assert (e.value.status, e.value.param) == (400, param), fields
    assert plan("hermes", tools=[WEATHER]) == ToolPlan("auto", "hermes", names=("get_weather",))


def test_chat_config_checks_its_flags(tmp_path):
    with pytest.raises(ConfigError, match="--tool-call-parser"):
        ChatConfig(enable_auto_tool_choice=True)
    with pytest.raises(ConfigError, match="no such file"):
        ChatConfig(chat_template=str(tmp_path / "missing.jinja"))
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }}")
    with pytest.raises(ConfigError, match="line 1"):
        ChatConfig(chat_template=str(bad))


# --- through `tessera serve`: SmolLM2, the shipped template, the hermes parser -------------------

@pytest.fixture(scope="module")
def client():
    with tessera_serve("--model", "smollm2", "--dtype", "float32", "--threads", "2", "--served-model-name",
                       "smollm2", "--chat-template", "chatml_tools", "--tool-call-parser", "hermes",
                       "--enable-auto-tool-choice", "--kv-cache-gib", "0.05") as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]


def chat(client, **kw):
    return client.chat.completions.create(model="smollm2", messages=kw.pop("messages", ASK),
                                          tools=kw.pop("tools", [WEATHER, TIME]),
                                          max_tokens=kw.pop("max_tokens", 80), **kw)


def stream_calls(client, **kw) -> tuple[str, list[dict], str | None]:
    content, calls, finish = "", [], None
    for chunk in chat(client, stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for entry in choice.delta.tool_calls or ():
                if entry.id:
                    calls.append({"name": entry.function.name, "arguments": entry.function.arguments or ""})
                else:
                    calls[entry.index]["arguments"] += entry.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


def calls_of(response) -> list[dict]:
    return [{"name": c.function.name, "arguments": c.function.arguments} for c in response.choices[0].message.tool_calls]


@pytest.mark.e2e
@pytest.mark.parametrize("choice, finish", [("required", "tool_calls"),
                                            ({"type": "function", "function": {"name": "get_time"}}, "stop")])
def test_forced_calls_validate_and_stream_alike(client, choice, finish):
    # one call (parallel_tool_calls false) keeps it short; the list of several is read by the
    # same code, tested above
    kw = dict(tool_choice=choice, parallel_tool_calls=False, temperature=1.0, seed=7)
    r = chat(client, **kw)
    assert r.choices[0].finish_reason == finish and r.choices[0].message.content is None
    calls = calls_of(r)
    assert len(calls) == 1
    assert all(c.id.startswith("call_") and c.type == "function" for c in r.choices[0].message.tool_calls)
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS[calls[0]["name"]])
    if isinstance(choice, dict):
        assert calls[0]["name"] == "get_time"
    assert stream_calls(client, **kw) == ("", calls, finish)


@pytest.mark.e2e
def test_history_with_calls_and_results(client):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees, sunny"}]
    r = chat(client, messages=history, tool_choice="required", parallel_tool_calls=False, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls"
    for c in calls_of(r):
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


@pytest.mark.e2e
def test_auto_reads_the_hermes_format_the_model_writes(client):
    """The output held to the Hermes format by a regex, so this small model writes a call: the
    parser turns it into tool_calls, streamed and not alike."""
    call = r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}\n</tool_call>'
    kw = dict(tool_choice="auto", temperature=0, extra_body={"structured_outputs": {"regex": "Sure\\. " + call}})
    r = chat(client, **kw)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content == "Sure."
    calls = calls_of(r)
    assert [c["name"] for c in calls] == ["get_time"]
    assert json.loads(calls[0]["arguments"])["zone"] in ("UTC", "CET")
    assert stream_calls(client, **kw) == ("Sure.", calls, "tool_calls")


@pytest.mark.e2e
@pytest.mark.parametrize("kw, param", [
    (dict(tool_choice={"type": "function", "function": {"name": "launch_rocket"}}), "tool_choice"),
    (dict(tool_choice="required", tools=[{"type": "function", "function": {      # a keyword no grammar takes
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "strin"}}}}}]), "tools"),
])
def test_refusals_are_400_naming_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, **kw)
    assert e.value.body["param"] == param


def test_a_deeply_nested_required_schema_is_a_400_naming_tools():
    from tessera.openai_api.tools import constraint, tool_plan
    schema: dict = {"type": "object"}
    for _ in range(600):
        schema = {"type": "object", "properties": {"a": schema}}
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tool_choice="required",
                                tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}])
    with pytest.raises(APIError) as e:
        constraint(req, tool_plan(req, ""))
    assert e.value.status == 400 and e.value.param == "tools"


def test_an_inline_chat_template_longer_than_a_file_name_is_the_template():
    from tessera.chat_config import template_text
    text = "{% for m in messages %}" + "x" * 300 + "/" + "y" * 300 + "{{ m.content }}{% endfor %}"
    assert template_text(text) == text
