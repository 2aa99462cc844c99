"""vLLM's POST /tokenize and /detokenize: the served model's tokenizer, asked of a worker (the
gateway holds no model). A prompt is tokenized as /v1/completions runs it; chat messages as
/v1/chat/completions renders them (the template, the generation prompt opened, the tools).
Unlike vLLM, they need an API key where the gateway has keys, and each call is admitted under
the key's limits: rendering a template costs a worker CPU time."""
from __future__ import annotations

import json
from typing import Annotated, Union

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field, StrictBool, StrictInt

from tessera.config import INT32_MAX
from tessera.entrypoints.gateway.admission import Admission
from tessera.openai_api.chat_messages import worker_messages
from tessera.openai_api.errors import APIError
from tessera.openai_api.protocol import ChatMessage, Text, Tool
from tessera.worker_api import TokenizeInput, WorkerClient

PATHS = ("/tokenize", "/detokenize")
MAX_DETOKENIZE = 1 << 17      # ids: more than any context holds


class TokenizeCompletion(BaseModel):
    model: Text | None = None
    prompt: Text
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChat(BaseModel):
    model: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[Tool] | None = None
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False


class Detokenize(BaseModel):
    model: Text | None = None
    tokens: Annotated[list[Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]], Field(max_length=MAX_DETOKENIZE)]


def add_tokenize_routes(app: FastAPI, client: WorkerClient, model_name: str, admission: Admission) -> None:
    """Each call is admitted as one generation is (the key's rate and in-flight limits): it
    costs a worker a tokenizer or template run."""
    max_messages = admission.config.max_messages

    def check(model: str | None) -> None:
        if model is not None and model != model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    async def admitted(request: Request, call):
        ticket = await admission.admit(getattr(request.state, "api_key", None), 1)
        try:
            return await call()
        finally:
            ticket.release()

    @app.post("/tokenize")
    async def tokenize(body: Union[TokenizeChat, TokenizeCompletion], request: Request):
        check(body.model)
        if isinstance(body, TokenizeChat):
            if len(body.messages) > max_messages:
                raise APIError(400, f"{len(body.messages)} messages; at most {max_messages} are allowed", "messages")
            if not body.add_generation_prompt:
                raise APIError(400, "add_generation_prompt false is not supported: messages are tokenized as a "
                               "chat request's prompt", "add_generation_prompt")
            tools = json.dumps([t.model_dump() for t in body.tools], ensure_ascii=False) if body.tools else None
            asked = TokenizeInput(messages=worker_messages(body.messages), tools=tools,
                                  return_token_strs=body.return_token_strs)
        else:
            asked = TokenizeInput(text=body.prompt, add_special_tokens=body.add_special_tokens,
                                  return_token_strs=body.return_token_strs)
        out = await admitted(request, lambda: client.tokenize(asked))
        return {"count": len(out.token_ids), "max_model_len": out.max_model_len, "tokens": list(out.token_ids),
                "token_strs": list(out.tokens) if body.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(body: Detokenize, request: Request):
        check(body.model)
        return {"prompt": await admitted(request, lambda: client.detokenize(tuple(body.tokens)))}
