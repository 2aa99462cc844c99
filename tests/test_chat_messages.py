"""Chat input as the official openai client sends it: an assistant's tool_calls, a tool message's
tool_call_id, `name`, content parts and the request's tools reach the chat template as the dicts
transformers' own apply_chat_template examples pass (arguments as a dict), through the gateway,
the worker protocol and the worker; a part that is not text, or a template that raises, is a 400
naming the message."""
from __future__ import annotations

import json

import openai
import pytest
from transformers import AutoTokenizer

from servers import tessera_serve
from tessera.openai_api.errors import APIError
from tessera.openai_api.params import chat_inputs
from tessera.openai_api.protocol import ChatCompletionRequest
from tessera.processor import Processor
from tessera.rpc.convert import generate_request_from_proto, generate_request_to_proto
from tessera.rpc.v1 import worker_pb2
from tessera.worker_api import InvalidRequest

# Qwen2.5's shape of tool template, short: tools as JSON, each call's arguments both as JSON and
# iterated as a dict (as Llama 3.1's template does), the tool answer's id, a message's name; it
# refuses a role it does not know, as many templates do.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unsupported role: ' + message.role) }}{% endif %}"
    "<|im_start|>{{ message.role }}{% if message.name is defined %} ({{ message.name }}){% endif %}\n"
    "{%- if message.content %}{{ message.content }}{% endif %}"
    "{%- if message.tool_calls is defined %}{% for call in message.tool_calls %}\n<tool_call>"
    "{\"id\": \"{{ call.id }}\", \"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}"
    "{% for key, value in call.function.arguments.items() %} {{ key }}={{ value }}{% endfor %}"
    "</tool_call>{% endfor %}{% endif %}"
    "{%- if message.tool_call_id is defined %}\n(answers {{ message.tool_call_id }}){% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# The conversation as the openai client sends it ...
SENT = [
    {"role": "system", "content": "You are terse.", "name": "rules"},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"},
                                 {"type": "text", "text": "And in Rome?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "19 C"}]},
]
# ... and as transformers' chat-template docs write it (arguments a dict; vLLM's null content "",
# text parts joined with "\n")
EXPECTED = [
    {"role": "system", "content": "You are terse.", "name": "rules"},
    {"role": "user", "content": "Weather in Paris?\nAnd in Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
    {"role": "tool", "content": "22 C", "tool_call_id": "call_1"},
    {"role": "tool", "content": "19 C", "tool_call_id": "call_2"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tessera.models.random_init import write_random_model
    path = write_random_model("llama", tmp_path_factory.mktemp("tools") / "llama", seed=0)
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def request(messages=SENT, **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=messages, **fields)


def worker_side(req: ChatCompletionRequest):
    """The gateway's input for the worker, through the protobuf bytes the worker receives."""
    (sent,) = chat_inputs(req, "r")
    wire = worker_pb2.GenerateRequest.FromString(generate_request_to_proto(sent).SerializeToString())
    return sent, generate_request_from_proto(wire)


def test_round_trip_keeps_every_field():
    sent, got = worker_side(request(tools=[WEATHER], tool_choice="none"))
    assert got == sent
    system, user, assistant, tool1, tool2 = got.messages
    assert (system.role, system.content, system.name) == ("system", "You are terse.", "rules")
    assert user.content == "Weather in Paris?\nAnd in Rome?" and user.name is None
    assert assistant.content is None and [(c.id, c.type, c.name, c.arguments) for c in assistant.tool_calls] == [
        ("call_1", "function", "get_weather", '{"city": "Paris"}'), ("call_2", "function", "get_weather", '{"city": "Rome"}')]
    assert (tool1.tool_call_id, tool1.content, tool2.tool_call_id, tool2.content) == ("call_1", "22 C", "call_2", "19 C")
    assert json.loads(got.tools) == [WEATHER]
    assert worker_side(request())[1].tools is None     # no tools: none reach the template


def test_worker_prompt_equals_transformers(tokenizer):
    _, got = worker_side(request(tools=[WEATHER], tool_choice="none"))
    text = tokenizer.apply_chat_template(EXPECTED, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    for piece in ('"description": "The weather in a city now."', "<|im_start|>system (rules)",
                  '"arguments": {"city": "Rome"}} city=Rome', "(answers call_2)", "Weather in Paris?\nAnd in Rome?"):
        assert piece in text, piece       # the template did render each field
    assert Processor(tokenizer).prompt_ids(got) == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_refusals_name_the_message(tokenizer):
    image = [{"role": "user", "content": "hi"}, {"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]
    with pytest.raises(APIError, match=r"messages\[1\]\.content\[1\].*'image_url'") as e:
        chat_inputs(request(image), "r")
    assert e.value.status == 400 and e.value.param == "messages"
    with pytest.raises(APIError, match="tool_choice") as e:
        chat_inputs(request(tools=[WEATHER]), "r")     # "auto": would need tool calls parsed
    assert e.value.param == "tools"
    for orphan in ([{"role": "tool", "tool_call_id": "call_1", "content": "22 C"}],
                   SENT[:1] + [{"role": "tool", "content": "22 C"}],
                   SENT + [{"role": "tool", "tool_call_id": "call_9", "content": "22 C"}]):
        with pytest.raises(APIError, match=r"messages\[\d+\]: a tool message must answer") as e:
            chat_inputs(request(orphan), "r")
        assert e.value.status == 400 and e.value.param == "messages"
    processor = Processor(tokenizer)
    developer = SENT[:2] + [{"role": "developer", "content": "be kind"}] + SENT[2:]
    with pytest.raises(InvalidRequest, match=r"at messages\[2\] \(role 'developer'\): unsupported role"):
        processor.prompt_ids(worker_side(request(developer))[1])
    bad = [dict(SENT[2], tool_calls=[{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}])]
    with pytest.raises(InvalidRequest, match=r"messages\[0\]\.tool_calls\[0\]\.function\.arguments"):
        processor.prompt_ids(worker_side(request(bad))[1])


def test_served_by_tessera_serve_with_the_openai_client(model_dir, tokenizer):
    with tessera_serve("--model", model_dir, "--dtype", "float32", "--max-model-len", "512", "--threads", "1",
                       "--served-model-name", "tiny") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.chat.completions.create(model="tiny", messages=SENT, tools=[WEATHER], tool_choice="none",
                                           max_tokens=3, temperature=0)
        text = tokenizer.apply_chat_template(EXPECTED, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
        assert r.usage.prompt_tokens == len(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert r.choices[0].message.tool_calls is None and r.usage.completion_tokens > 0
        image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
        with pytest.raises(openai.BadRequestError, match=r"messages\[0\].*image_url") as e:
            client.chat.completions.create(model="tiny", messages=image, max_tokens=3)
        assert e.value.status_code == 400
        developer = [{"role": "user", "content": "hi"}, {"role": "developer", "content": "be kind"}]
        with pytest.raises(openai.BadRequestError, match=r"at messages\[1\] \(role 'developer'\)"):
            client.chat.completions.create(model="tiny", messages=developer, max_tokens=3)
