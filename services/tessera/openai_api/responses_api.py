"""OpenAI's Responses API as a translation of the chat API: a ResponsesRequest (with the
conversation a stored previous response left) becomes a ChatCompletionRequest, which the chat
path runs; its body becomes a Response object. The stream's events are responses_stream.py's.

Instructions open the messages of this turn only: as in OpenAI's API, they are not carried over
to a response that continues this one (its `previous_response_id`)."""
from __future__ import annotations

import time
from typing import Literal, Union

from pydantic import BaseModel, Field, StrictBool, StrictInt, ValidationError

from tessera.openai_api.errors import APIError, validation_message
from tessera.openai_api.protocol import ChatCompletionRequest, Number, Text

# fields of OpenAI's request this server cannot honour: a 400 naming them rather than a
# silently different answer (a value in the tuple is the one harmless setting, also accepted)
UNSUPPORTED = {"background": (False, None), "include": ([], None), "conversation": (None,), "prompt": (None,),
               "max_tool_calls": (None,), "top_logprobs": (None, 0), "truncation": ("disabled", None)}
# chat's parameter names, as the caller of the Responses API knows them
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "response_format": "text"}
_CHAT_ROLES = ("system", "developer", "user", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel, extra="allow"):
    """POST /v1/responses. Items, tools and formats are checked as they are translated
    (to_chat), so an error names the item (`input[2].content`) the way OpenAI's does."""

    model: Text
    input: Union[Text, list[dict]]
    instructions: Text | None = None
    tools: list[dict] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict, None] = None
    parallel_tool_calls: StrictBool | None = None
    text: dict | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Number | None = None
    top_p: Number | None = None
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: Text | None = None
    metadata: dict[Text, Text] | None = Field(None, max_length=16)
    reasoning: dict | None = None
    user: Text | None = None

    def check_supported(self) -> None:
        extra = self.model_extra or {}
        for name, allowed in UNSUPPORTED.items():
            if name in extra and extra[name] not in allowed:
                raise APIError(400, f"'{name}' is not supported by this server.", name, "unsupported_parameter")
        if set(self.reasoning or {}) - {"effort"}:     # effort is ignored: the models served do not reason
            raise APIError(400, "reasoning: only 'effort' is accepted (and ignored) by this server.",
                           "reasoning", "unsupported_parameter")


def to_chat(req: ResponsesRequest, history: list[dict]) -> tuple[ChatCompletionRequest, list[dict]]:
    """The chat request for this turn, and the conversation (history + this turn's input, without
    the instructions) that a response continuing this one starts from."""
    req.check_supported()
    turn = input_messages(req.input)
    conversation = [*history, *turn]
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    body = {"model": req.model, "messages": messages, "stream": req.stream, "temperature": req.temperature,
            "top_p": req.top_p, "max_tokens": req.max_output_tokens, "user": req.user,
            "response_format": response_format(req.text), "tools": chat_tools(req.tools),
            "tool_choice": chat_tool_choice(req.tool_choice), "parallel_tool_calls": req.parallel_tool_calls}
    if req.stream:
        body["stream_options"] = {"include_usage": True}     # the final event carries usage
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None}), conversation
    except ValidationError as e:
        message, param = validation_message(list(e.errors()))
        raise APIError(400, message, _PARAMS.get(param, param)) from None


def responses_param(e: APIError) -> APIError:
    """An error the chat path raised, naming the Responses API's parameter."""
    e.param = _PARAMS.get(e.param, e.param)
    return e


def input_messages(items: str | list[dict]) -> list[dict]:
    """Input items -> chat messages: message items by role, function_call items as the assistant's
    tool_calls (consecutive calls, and a call after assistant text, share one message) and
    function_call_output items as role "tool" messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _CHAT_ROLES:
                raise APIError(400, f"input[{i}].role: expected one of {', '.join(_CHAT_ROLES)}", f"input[{i}].role")
            messages.append({"role": role, "content": _content(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": _text(item, "call_id", i), "type": "function",
                    "function": {"name": _text(item, "name", i), "arguments": _text(item, "arguments", i)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _text(item, "call_id", i),
                             "content": _content(item.get("output"), f"input[{i}].output")})
        else:
            raise APIError(400, f"input[{i}].type: item type {str(kind)[:40]!r} is not supported (message, "
                           "function_call, function_call_output are)", f"input[{i}].type")
    return messages


def _text(item: dict, key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"input[{i}].{key}: a string is required", f"input[{i}].{key}")
    return value


def _content(content, where: str) -> str | list[dict]:
    """A string, or text parts (input_text / output_text) as chat's text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise APIError(400, f"{where}: a string or a non-empty list of content parts is required", where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}[{j}]: only text parts (input_text, output_text) are supported; the "
                           "models served take text only", f"{where}[{j}]")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Function tools, flat as the Responses API has them, in chat's nested shape."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise APIError(400, f"tools[{i}].type: only function tools are supported (not built-in tools such as "
                           f"{str(tool.get('type'))[:40]!r})", f"tools[{i}].type", "unsupported_parameter")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out or None


def chat_tool_choice(choice) -> str | dict | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise APIError(400, "tool_choice: a mode (none, auto, required) or {\"type\": \"function\", \"name\": ...}",
                       "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def response_format(text: dict | None) -> dict | None:
    """text.format -> chat's response_format (the schema checks are the chat path's)."""
    fmt = (text or {}).get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    if not isinstance(fmt, dict):
        raise APIError(400, "text.format: an object such as {\"type\": \"json_schema\", \"name\", \"schema\"} "
                       "is required", "text")
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return dict(fmt)    # json_object, or a type the chat path refuses naming response_format (-> text)


def output_items(rid: str, text: str, tool_calls: list[dict], status: str) -> list[dict]:
    """The message (when there is text or nothing else) and one function_call item per call, each
    with the response's status ("incomplete" when max_output_tokens cut it). Ids derive from the request id, so the stream's events and the final object agree."""
    items = []
    if text or not tool_calls:
        items.append({"type": "message", "id": f"msg_{rid}", "status": status, "role": "assistant",
                      "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
    for i, call in enumerate(tool_calls):
        items.append({"type": "function_call", "id": f"fc_{rid}_{i}", "call_id": call.get("id") or f"call_{rid}_{i}",
                      "name": call["function"]["name"], "arguments": call["function"].get("arguments", ""),
                      "status": status})
    return items


def response_object(req: ResponsesRequest, rid: str, model: str, created_at: int, output: list[dict],
                    finish_reason: str | None, chat_usage: dict | None, status: str | None = None) -> dict:
    """A Response (OpenAI's shape), echoing the request's settings as OpenAI does."""
    if status is None:
        status = "incomplete" if finish_reason == "length" else "completed"
    usage = None
    if chat_usage is not None:
        usage = {"input_tokens": chat_usage["prompt_tokens"], "output_tokens": chat_usage["completion_tokens"],
                 "total_tokens": chat_usage["total_tokens"],
                 "input_tokens_details": {"cached_tokens": chat_usage.get("prompt_tokens_details", {})
                                          .get("cached_tokens", 0)},
                 "output_tokens_details": {"reasoning_tokens": 0}}
    return {"id": f"resp_{rid}", "object": "response", "created_at": created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "model": model, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "tool_choice": req.tool_choice or "auto",
            "tools": [dict(t, strict=t.get("strict")) for t in req.tools or []],
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
            "metadata": req.metadata or {}, "store": req.store, "truncation": "disabled", "user": req.user,
            "background": False, "usage": usage}


def from_chat_body(req: ResponsesRequest, rid: str, body: dict, created_at: int) -> tuple[dict, dict]:
    """(the Response, the assistant's chat message for the stored conversation) of a chat body."""
    choice = body["choices"][0]
    message = choice["message"]
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    output = output_items(rid, message.get("content") or "", message.get("tool_calls") or [], status)
    return response_object(req, rid, body["model"], created_at, output, choice["finish_reason"], body["usage"]), \
        assistant_message(output)


def assistant_message(output: list[dict]) -> dict:
    """The output items as the assistant's chat message (text and tool calls), for the history."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    return {"role": "assistant", "content": text if text or not calls else None,
            **({"tool_calls": calls} if calls else {})}
