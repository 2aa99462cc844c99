"""Chat messages -> prompt token ids in the worker: each message becomes the dict a Hugging Face
chat template reads, and the template renders them with the request's tools, as vLLM does
(its chat_utils): a null content is "", an assistant's tool-call arguments are parsed from JSON
text into what they encode (templates such as Llama 3.1's iterate them as a dict), `name` and
`tool_call_id` appear only where the client sent them. A template that raises is the caller's
400, naming the first message at which it raises."""
from __future__ import annotations

import json

from transformers import PreTrainedTokenizerBase

from tessera.worker_api import ChatMessage, InvalidRequest


def conversation(messages: tuple[ChatMessage | tuple[str, str], ...]) -> list[dict]:
    """The messages as template dicts; InvalidRequest names a tool call whose arguments are not JSON."""
    out = []
    for i, m in enumerate(ChatMessage(*m) for m in messages):
        d = {"role": m.role, "content": m.content or ""}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": c.type,
                                "function": {"name": c.name, "arguments": _arguments(c.arguments, i, j)}}
                               for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def tool_list(tools: str | None) -> list[dict] | None:
    try:
        return json.loads(tools) if tools else None
    except (ValueError, RecursionError) as e:    # only a worker client other than the gateway sends these
        raise InvalidRequest(f"tools are not a JSON list: {str(e)[:200]}", "tools") from None


def prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: tuple[ChatMessage, ...],
               tools: str | None) -> list[int]:
    conv, tool_defs = conversation(messages), tool_list(tools)
    try:
        ids = tokenizer.apply_chat_template(conv, tools=tool_defs, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # a template may raise on roles or fields it does not accept
        raise InvalidRequest(f"chat template failed{_where(tokenizer, conv, tool_defs, e)}: {e}",
                             "messages") from e
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _arguments(text: str, i: int, j: int):
    if not text:       # vLLM's rule: no arguments are an empty object
        return {}
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:     # RecursionError: nested deeper than Python's stack
        raise InvalidRequest(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON: "
                             f"{str(e)[:200]}", "messages") from None


def _where(tokenizer, conv: list[dict], tools, error: Exception) -> str:
    """' at messages[i] (role r)' for the shortest prefix of the conversation that raises the same
    error, found by bisection (the error path only: log2(len) renders); '' when the empty
    conversation raises it too, so the error is about no one message."""
    def raises(k: int) -> bool:
        try:
            tokenizer.apply_chat_template(conv[:k], tools=tools, add_generation_prompt=True, tokenize=False)
        except Exception as e:
            return type(e) is type(error) and str(e) == str(error)
        return False
    lo, hi = 0, len(conv)        # invariant: prefix hi raises the error, prefix lo does not
    if raises(lo):
        return ""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if raises(mid) else (mid, hi)
    return f" at messages[{hi - 1}] (role {conv[hi - 1]['role']!r})"
