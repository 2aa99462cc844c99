"""POST /v1/responses, GET and DELETE /v1/responses/{id}: the Responses API on the gateway.
A request is translated (openai_api/responses_api.py) into a chat request that the chat route's
own work (app.state.run_chat) runs; its body or chunks are translated back. Stored responses
live in the Redis that holds the gateways' shared state (the Batch API's --jobs-redis, else the
registry's), under the deployment's key prefix, else in this gateway's memory."""
from __future__ import annotations

import json
import logging
import re
import time
from contextlib import aclosing

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from tessera.batch_jobs.redis_jobs import RedisJobStore
from tessera.openai_api.errors import APIError
from tessera.openai_api.responses_api import ResponsesRequest, from_chat_body, responses_param, to_chat
from tessera.openai_api.responses_stream import response_events
from tessera.responses_store import MemoryResponseStore, RedisResponseStore, ResponseStore, StoredResponse

log = logging.getLogger("tessera.gateway")
_ID = re.compile(r"resp_[0-9a-f]{1,64}")
PUBLIC_OWNER = "public"     # the owner of every response when the gateway takes no API keys


def add_responses_routes(app: FastAPI, batch=None) -> None:
    """batch: the app's BatchAPI (batch_api.py) or None; its Redis connection is reused."""
    app.state.responses_store = store = _store(app.state.admission, batch)

    @app.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request):
        owner = _owner(request)
        history = (await _load(store, owner, body.previous_response_id, "previous_response_id")).conversation \
            if body.previous_response_id else []
        chat, conversation = to_chat(body, history)
        rid, created_at = request.state.request_id, int(time.time())
        try:
            result = await request.app.state.run_chat(chat, request)
        except APIError as e:
            raise responses_param(e) from None

        async def finish(response: dict, message: dict) -> None:
            if body.store:
                await _save(store, owner, StoredResponse(response, [*conversation, message]))

        if body.stream:
            events = response_events(body, rid, chat.model, created_at, result, finish)
            return StreamingResponse(_sse(events), media_type="text/event-stream")
        response, message = from_chat_body(body, rid, result, created_at)
        await finish(response, message)
        return response

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request):
        return (await _load(store, _owner(request), response_id)).response

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request):
        if not _ID.fullmatch(response_id) or not await _call(store.delete(_owner(request), response_id)):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def _store(admission, batch) -> ResponseStore:
    if batch is not None and isinstance(batch.store, RedisJobStore):
        return RedisResponseStore(batch.store.redis, batch.store.prefix)
    if admission.redis is not None:
        return RedisResponseStore(admission.redis, admission.prefix)
    return MemoryResponseStore()


def _owner(request: Request) -> str:
    key = getattr(request.state, "api_key", None)
    return key.counter_id if key is not None else PUBLIC_OWNER


async def _load(store: ResponseStore, owner: str, response_id: str, param: str = "response_id") -> StoredResponse:
    record = await _call(store.get(owner, response_id)) if _ID.fullmatch(response_id) else None
    if record is None:
        raise _not_found(response_id, param)
    return record


async def _save(store: ResponseStore, owner: str, record: StoredResponse) -> None:
    try:
        await _call(store.put(owner, record))
    except ValueError as e:      # larger than the whole memory store
        raise APIError(400, f"the response cannot be stored: {e}", "store") from None


async def _call(operation):
    """A store operation; Redis unreachable is a 503 the client may retry."""
    try:
        return await operation
    except (ValueError, APIError):
        raise
    except Exception as e:
        log.warning("responses store: %s: %s", type(e).__name__, e)
        raise APIError(503, "The response store is unavailable; retry later.", None, "store_unavailable", 1) from None


def _not_found(response_id: str, param: str = "response_id") -> APIError:
    return APIError(404, f"Response with id '{response_id[:80]}' not found.", param, "not_found")


async def _sse(events):
    """OpenAI's framing: each event named on its own `event:` line; no [DONE]. Closed with the
    response, so a client that leaves aborts the generation and frees its admission at once."""
    async with aclosing(events):
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
