"""A chat request's messages and tools -> what the worker gets (worker_api.ChatMessage, tools as
JSON text), as vLLM reads them for a text-only model: text parts joined with "\\n", an
assistant's tool_calls and a tool message's tool_call_id kept where OpenAI's API puts them,
`name` on any message. A part that is not text is a 400 naming the message and the part type;
so is a tool message that answers no earlier assistant tool call (OpenAI's rule: a template
would render a result with no call before it).

Tools: the template sees them whatever tool_choice is (vLLM's default); how the output becomes
tool calls is tools.py's."""
from __future__ import annotations

import json

from tessera.openai_api.errors import APIError
from tessera.openai_api.protocol import ChatCompletionRequest, ChatMessage as Message, TextPart
from tessera.worker_api import ChatMessage, ToolCall


def worker_messages(messages: list[Message]) -> tuple[ChatMessage, ...]:
    calls: set[str] = set()
    for i, m in enumerate(messages):
        if m.role == "assistant":
            calls.update(c.id for c in m.tool_calls or ())
        elif m.role == "tool" and m.tool_call_id not in calls:
            raise APIError(400, f"messages[{i}]: a tool message must answer an earlier assistant message's "
                           f"tool call; tool_call_id {str(m.tool_call_id)[:64]!r} is not one", "messages")
    return tuple(_message(i, m) for i, m in enumerate(messages))


def worker_tools(req: ChatCompletionRequest) -> str | None:
    """The tools as the JSON list the template gets (vLLM's shape: type, function {name,
    description, parameters}, unset ones null); None without tools."""
    if not req.tools:
        return None
    return json.dumps([t.model_dump() for t in req.tools], ensure_ascii=False)


def _message(i: int, m: Message) -> ChatMessage:
    calls = tuple(ToolCall(c.id, c.function.name, c.function.arguments, c.type)
                  for c in m.tool_calls or ()) if m.role == "assistant" else ()
    return ChatMessage(m.role, _text(i, m.content), m.name,
                       m.tool_call_id if m.role == "tool" else None, calls)


def _text(i: int, content) -> str | None:
    if not isinstance(content, list):
        return content
    for k, part in enumerate(content):
        if not isinstance(part, TextPart):
            raise APIError(400, f"messages[{i}].content[{k}]: content parts of type {part.type[:32]!r} are not "
                           "supported: this model takes text only", "messages")
    return "\n".join(p.text for p in content)
