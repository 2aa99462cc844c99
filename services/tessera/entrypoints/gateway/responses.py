"""Non-streaming OpenAI response bodies built from collected choices."""
from __future__ import annotations

import time

from tessera.openai_api.serving import Choice, chat_logprobs, completion_logprobs, usage


def chat_body(rid: str, model: str, choices: list[Choice], logprobs: bool) -> dict:
    return {
        "id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                     "logprobs": chat_logprobs(c.logprobs) if logprobs else None,
                     "finish_reason": c.finish_reason} for c in choices],
        "usage": usage(choices, len(choices)),
    }


def completion_body(rid: str, model: str, choices: list[Choice], n: int, logprobs: bool,
                    echo_prompts: list[str] | None) -> dict:
    out = []
    for c in choices:
        prefix = echo_prompts[c.index // n] if echo_prompts else ""
        out.append({"index": c.index, "text": prefix + c.text,
                    "logprobs": completion_logprobs(c.logprobs, len(prefix)) if logprobs else None,
                    "finish_reason": c.finish_reason})
    return {"id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": out, "usage": usage(choices, n)}
