"""vLLM's POST /tokenize and /detokenize: the served model's tokenizer, asked of a worker (the
gateway holds no model). A prompt is tokenized as /v1/completions runs it; chat messages as
/v1/chat/completions renders them (the template, the generation prompt opened, the tools).
Unlike vLLM, they need an API key where the gateway has keys: rendering a template costs a
worker CPU time."""
from __future__ import annotations

import json
from typing import Annotated, Union

from fastapi import FastAPI
from pydantic import BaseModel, Field, StrictBool, StrictInt

from tessera.openai_api.chat_messages import worker_messages
from tessera.openai_api.errors import APIError
from tessera.openai_api.protocol import ChatMessage, Text, Tool
from tessera.worker_api import TokenizeInput, WorkerClient

PATHS = ("/tokenize", "/detokenize")
MAX_DETOKENIZE = 1 << 20      # ids; a body of the gateway's size limit holds fewer


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
    tokens: Annotated[list[StrictInt], Field(max_length=MAX_DETOKENIZE)]


def add_tokenize_routes(app: FastAPI, client: WorkerClient, model_name: str, max_messages: int) -> None:
    def check(model: str | None) -> None:
        if model is not None and model != model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    @app.post("/tokenize")
    async def tokenize(body: Union[TokenizeChat, TokenizeCompletion]):
        check(body.model)
        if isinstance(body, TokenizeChat):
            if len(body.messages) > max_messages:
                raise APIError(400, f"{len(body.messages)} messages; at most {max_messages} are allowed", "messages")
            if not body.add_generation_prompt:
                raise APIError(400, "add_generation_prompt false is not supported: messages are tokenized as a "
                               "chat request's prompt", "add_generation_prompt")
            tools = json.dumps([t.model_dump() for t in body.tools], ensure_ascii=False) if body.tools else None
            request = TokenizeInput(messages=worker_messages(body.messages), tools=tools)
        else:
            request = TokenizeInput(text=body.prompt, add_special_tokens=body.add_special_tokens)
        out = await client.tokenize(request)
        return {"count": len(out.token_ids), "max_model_len": out.max_model_len, "tokens": list(out.token_ids),
                "token_strs": list(out.tokens) if body.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(body: Detokenize):
        check(body.model)
        return {"prompt": await client.detokenize(tuple(body.tokens))}
