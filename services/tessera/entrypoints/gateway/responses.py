"""Non-streaming OpenAI response bodies built from collected choices."""
from __future__ import annotations

import time

from tessera import tracing
from tessera.openai_api.serving import Choice, chat_logprobs, completion_logprobs, usage
from tessera.openai_api.tool_stream import message
from tessera.openai_api.tools import ToolPlan


def chat_body(rid: str, model: str, choices: list[Choice], logprobs: bool, tools: ToolPlan | None = None) -> dict:
    """tools: the request's tool plan; with calls to read from the output, each message holds
    them as OpenAI's tool_calls (tool_stream.message)."""
    out = [_chat_choice(c, logprobs, tools) for c in choices]
    return {
        "id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": out,
        "usage": tracing.record_usage(usage(choices, len(choices)), [c["finish_reason"] for c in out]),
    }


def _chat_choice(c: Choice, logprobs: bool, tools: ToolPlan | None) -> dict:
    if tools is None or tools.mode == "none":
        msg, finish = {"role": "assistant", "content": c.text}, c.finish_reason
    else:
        msg, finish = message(tools, c.text, c.finish_reason)
    return {"index": c.index, "message": msg, "logprobs": chat_logprobs(c.logprobs) if logprobs else None,
            "finish_reason": finish}


def completion_body(rid: str, model: str, choices: list[Choice], n: int, logprobs: bool,
                    echo_prompts: list[str] | None) -> dict:
    out = []
    for c in choices:
        prefix = echo_prompts[c.index // n] if echo_prompts else ""
        out.append({"index": c.index, "text": prefix + c.text,
                    "logprobs": completion_logprobs(c.logprobs, len(prefix)) if logprobs else None,
                    "finish_reason": c.finish_reason})
    return {"id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": out,
            "usage": tracing.record_usage(usage(choices, n), [c["finish_reason"] for c in out])}
