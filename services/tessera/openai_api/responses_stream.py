"""A streamed chat completion's chunk dicts -> the Responses API's events, in OpenAI's order:
response.created, response.in_progress, then per output item output_item.added, (message)
content_part.added, output_text.delta..., output_text.done, content_part.done or (function call)
function_call_arguments.delta..., .done, and output_item.done; last response.completed (or
response.incomplete when max_output_tokens cut it; an `error` event and response.failed when
the generation fails). Every event carries a sequence_number, counted from 0."""
from __future__ import annotations

from contextlib import aclosing
from typing import AsyncIterator, Awaitable, Callable

from tessera.openai_api.errors import APIError
from tessera.openai_api.responses_api import ResponsesRequest, assistant_message, response_object

# called with (the final Response, the assistant's chat message) before the last event: stores it
Finish = Callable[[dict, dict], Awaitable[None]]


class _Items:
    """The output items as they open and close, and the events that say so."""

    def __init__(self, rid: str) -> None:
        self.rid, self.output, self.seq = rid, [], 0
        self.message: dict | None = None           # the open message item
        self.calls: dict[int, dict] = {}            # chat's tool call index -> its open item

    def event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def text(self, delta: str) -> list[dict]:
        events = []
        if self.message is None:
            self.message = {"type": "message", "id": f"msg_{self.rid}", "status": "in_progress", "role": "assistant",
                            "content": []}
            self.output.append(self.message)
            events += [self.event("response.output_item.added", output_index=len(self.output) - 1,
                                  item=dict(self.message, content=[])),
                       self.event("response.content_part.added", **self._at(self.message), content_index=0,
                                  part=_part(""))]
            self.message["content"].append(_part(""))
        self.message["content"][0]["text"] += delta
        return events + [self.event("response.output_text.delta", **self._at(self.message), content_index=0,
                                    delta=delta, logprobs=[])]

    def tool_call(self, delta: dict) -> list[dict]:
        events = self._close_message("completed")
        index, function = delta.get("index", 0), delta.get("function") or {}
        item = self.calls.get(index)
        if item is None:
            item = {"type": "function_call", "id": f"fc_{self.rid}_{len(self.calls)}",
                    "call_id": delta.get("id") or f"call_{self.rid}_{len(self.calls)}",
                    "name": function.get("name") or "", "arguments": "", "status": "in_progress"}
            self.calls[index] = item
            self.output.append(item)
            events.append(self.event("response.output_item.added", output_index=len(self.output) - 1,
                                     item=dict(item)))
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            events.append(self.event("response.function_call_arguments.delta", **self._at(item),
                                     delta=function["arguments"]))
        return events

    def close(self, status: str) -> list[dict]:
        events = self._close_message(status)
        for item in self.calls.values():
            item["status"] = status
            events += [self.event("response.function_call_arguments.done", **self._at(item),
                                  arguments=item["arguments"]),
                       self.event("response.output_item.done", output_index=self.output.index(item), item=dict(item))]
        self.calls = {}
        return events

    def _close_message(self, status: str) -> list[dict]:
        if self.message is None:
            return []
        item, self.message = self.message, None
        item["status"], part = status, item["content"][0]
        return [self.event("response.output_text.done", **self._at(item), content_index=0, text=part["text"],
                           logprobs=[]),
                self.event("response.content_part.done", **self._at(item), content_index=0, part=dict(part)),
                self.event("response.output_item.done", output_index=self.output.index(item), item=item)]

    def _at(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.output.index(item)}


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


async def response_events(req: ResponsesRequest, rid: str, model: str, created_at: int,
                          chunks: AsyncIterator[dict], finish: Finish) -> AsyncIterator[dict]:
    """The events of one streamed response; `finish` runs once the output is complete. Closing
    it closes the chunks (the chat stream aborts its generation and releases its admission)."""
    async with aclosing(chunks):
        async for event in _events(req, rid, model, created_at, chunks, finish):
            yield event


async def _events(req: ResponsesRequest, rid: str, model: str, created_at: int,
                  chunks: AsyncIterator[dict], finish: Finish) -> AsyncIterator[dict]:
    items = _Items(rid)
    started = response_object(req, rid, model, created_at, [], None, None, status="in_progress")
    yield items.event("response.created", response=started)
    yield items.event("response.in_progress", response=started)
    finish_reason, usage = None, None
    async for chunk in chunks:
        if "error" in chunk:
            error = chunk["error"]
            yield items.event("error", code=error.get("code"), message=error["message"], param=error.get("param"))
            failed = response_object(req, rid, model, created_at, items.output, None, usage, status="failed")
            yield items.event("response.failed", response=dict(
                failed, error={"code": error.get("code") or "server_error", "message": error["message"]}))
            return
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            for event in items.text(delta["content"]) if delta.get("content") else ():
                yield event
            for call in delta.get("tool_calls") or ():
                for event in items.tool_call(call):
                    yield event
            finish_reason = choice.get("finish_reason") or finish_reason
    if not items.output:     # nothing generated: still one (empty) message, as the non-streamed body has
        for event in items.text(""):
            if event["type"] != "response.output_text.delta":
                yield event
    for event in items.close("incomplete" if finish_reason == "length" else "completed"):
        yield event
    final = response_object(req, rid, model, created_at, items.output, finish_reason, usage)
    try:
        await finish(final, assistant_message(items.output))
    except APIError as e:
        yield items.event("error", code=e.code, message=e.message, param=e.param)
        yield items.event("response.failed", response=dict(final, status="failed", error={
            "code": e.code or "server_error", "message": e.message}))
        return
    yield items.event("response.completed" if final["status"] == "completed" else "response.incomplete",
                      response=final)
