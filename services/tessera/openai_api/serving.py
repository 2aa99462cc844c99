"""Run a request's GenerateInputs on a worker and shape OpenAI responses: one JSON body, or
server-sent events (first chat delta carries the role, optional usage chunk, `data: [DONE]`).

Each choice is one worker request; choices run concurrently and their chunks are merged.
Errors before the first chunk become HTTP errors; errors mid-stream become an error event.
"""
from __future__ import annotations

import asyncio
import json
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator

from tessera import tracing
from tessera.metrics import GatewayMetrics
from tessera.openai_api.errors import error_body
from tessera.openai_api.tool_stream import ToolStream
from tessera.openai_api.tools import ToolPlan
from tessera.worker_api import GenerateChunk, GenerateInput, WorkerClient, WorkerError


@dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    accepted_tokens: int = 0      # speculative decoding: draft tokens accepted (cumulative per choice)
    rejected_tokens: int = 0
    cached_tokens: int = 0        # prompt tokens the worker's prefix cache served

    def add(self, item: GenerateChunk) -> None:
        """Take one chunk's text, tokens and counts (logprobs and finish reason are the caller's)."""
        self.text += item.text
        self.token_ids.extend(item.token_ids)
        self.prompt_tokens, self.cached_tokens = item.prompt_tokens, item.cached_tokens
        self.accepted_tokens, self.rejected_tokens = item.accepted_tokens, item.rejected_tokens


async def merged(client: WorkerClient, inputs: list[GenerateInput], metrics: GatewayMetrics | None
                 ) -> AsyncIterator[tuple[int, GenerateChunk | WorkerError]]:
    """(choice index, chunk) from every input as they arrive; an error ends that choice.
    metrics None: not a user request (the health probe), so nothing is recorded."""
    if len(inputs) == 1:       # the usual case: no task and no queue between stream and caller
        async with aclosing(_choice(client, inputs[0], metrics)) as items:
            async for item in items:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, inp: GenerateInput) -> None:
        try:
            async for item in _choice(client, inp, metrics):
                await queue.put((i, item))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, inp)) for i, inp in enumerate(inputs)]
    try:
        open_choices = len(tasks)
        while open_choices:
            i, item = await queue.get()
            if item is None:
                open_choices -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _choice(client: WorkerClient, inp: GenerateInput, metrics: GatewayMetrics | None
                  ) -> AsyncIterator[GenerateChunk | WorkerError]:
    """One choice's chunks, observed by the metrics; a failure is its last item. Closing it
    closes the worker stream at once (the gRPC call is cancelled, the worker aborts)."""
    start = last = time.monotonic()
    spec = (0, 0)      # this choice's accepted, rejected draft tokens so far
    try:
        async with aclosing(client.generate(inp)) as chunks:
            async for chunk in chunks:
                now = time.monotonic()
                if metrics is not None:
                    metrics.observe_token(chunk, now - start, now - last, first=last == start)
                    spec = metrics.observe_spec(chunk, spec)
                    metrics.observe_finish(chunk)
                last = now
                yield chunk
    except WorkerError as e:
        yield e
    except Exception as e:  # a bug or transport failure must still end the choice
        yield WorkerError(f"{type(e).__name__}: {e}")
    finally:
        if metrics is not None:
            metrics.observe_e2e(time.monotonic() - start)


async def collect(client: WorkerClient, inputs: list[GenerateInput], metrics: GatewayMetrics | None
                  ) -> list[Choice]:
    choices = [Choice(i) for i in range(len(inputs))]
    async for i, item in merged(client, inputs, metrics):
        if isinstance(item, WorkerError):
            raise item
        c = choices[i]
        c.add(item)
        c.logprobs.extend(item.logprobs)
        c.finish_reason = item.finish_reason or c.finish_reason
    return choices


def usage(choices: list[Choice], n: int) -> dict:
    """Prompt tokens count once per prompt (every n-th choice), and so do the cached ones
    (prompt_tokens_details.cached_tokens, always there as in OpenAI's answers; 0 when the
    prefix cache had nothing); completion tokens per choice. completion_tokens_details
    (accepted / rejected prediction tokens, OpenAI's names) appears only when the worker
    verified draft tokens for this request, so plain decoding answers exactly as before."""
    prompt = sum(c.prompt_tokens for c in choices[::n])
    completion = sum(len(c.token_ids) for c in choices)
    body: dict = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                  "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in choices[::n])}}
    accepted, rejected = sum(c.accepted_tokens for c in choices), sum(c.rejected_tokens for c in choices)
    if accepted or rejected:
        body["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                             "rejected_prediction_tokens": rejected}
    return body


def chat_logprobs(lps) -> dict:
    return {"content": [{
        "token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token_bytes),
        "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token_bytes)}
                         for t in lp.top]} for lp in lps]}


def completion_logprobs(lps, offset: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        tokens.append(lp.token)
        token_lps.append(lp.logprob)
        tops.append({t.token: t.logprob for t in lp.top} if lp.top else None)
        offsets.append(offset)
        offset += len(lp.token)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


@dataclass
class StreamShape:
    """What differs between the chat and completions streams."""

    id: str
    model: str
    chat: bool
    include_usage: bool
    logprobs: bool
    n: int = 1
    created: int = field(default_factory=lambda: int(time.time()))
    tools: ToolPlan | None = None       # chat with tool calls to read from the output

    def tool_streams(self, num_choices: int) -> list[ToolStream] | None:
        if self.tools is None or self.tools.mode == "none":
            return None
        return [ToolStream(self.tools) for _ in range(num_choices)]

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            body["usage"] = usage
        return body


async def start(client: WorkerClient, inputs: list[GenerateInput], metrics: GatewayMetrics):
    """Begin a streamed request and wait for its first event, so that an error the worker
    raises up front (bad parameters, context too long, saturated) is still an HTTP error."""
    events = merged(client, inputs, metrics)
    first = await anext(events)
    if isinstance(first[1], WorkerError):
        await events.aclose()
        raise first[1]
    return first, events


async def stream(first, events, num_choices: int, shape: StreamShape) -> AsyncIterator[dict]:
    """The response's chunks as dicts (an error mid-stream is an error body, the last item);
    `sse_lines` encodes them for the wire, other APIs (Responses) translate them."""
    choices = [Choice(i) for i in range(num_choices)]
    tool_streams = shape.tool_streams(num_choices)
    if shape.chat:
        yield shape.chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None} for i in range(num_choices)])
    async for i, item in _prepend(first, events):
        if isinstance(item, WorkerError):
            yield error_body(item.status, str(item), item.param, item.code)
            return
        c = choices[i]
        offset = len(c.text)
        c.add(item)
        c.finish_reason = item.finish_reason
        if tool_streams is not None:
            delta, finish = tool_streams[i].feed(item.text, item.finish_reason)
            if delta or finish or (shape.logprobs and item.logprobs):
                yield shape.chunk([_chat_choice(shape, i, item, delta, finish)])
            continue
        if not item.text and not item.finish_reason and not (shape.logprobs and item.logprobs):
            continue
        yield shape.chunk([_stream_choice(shape, i, item, offset)])
    counted = tracing.record_usage(usage(choices, shape.n), [c.finish_reason for c in choices])
    if shape.include_usage:
        yield shape.chunk([], counted)


async def sse_lines(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Server-sent events of a chunk stream, ended by `data: [DONE]` however it ends."""
    async with aclosing(chunks):
        async for chunk in chunks:
            yield sse(chunk)
    yield sse("[DONE]")


async def _prepend(first, events):
    try:
        yield first
        async for event in events:
            yield event
    finally:
        await events.aclose()


def _chat_choice(shape: StreamShape, i: int, item: GenerateChunk, delta: dict, finish: str | None) -> dict:
    lps = chat_logprobs(item.logprobs) if shape.logprobs else None
    return {"index": i, "delta": delta, "logprobs": lps, "finish_reason": finish}


def _stream_choice(shape: StreamShape, i: int, item: GenerateChunk, offset: int) -> dict:
    if shape.chat:
        return _chat_choice(shape, i, item, {"content": item.text} if item.text else {}, item.finish_reason)
    lps = completion_logprobs(item.logprobs, offset) if shape.logprobs else None
    return {"index": i, "text": item.text, "logprobs": lps, "finish_reason": item.finish_reason}
