"""Send batch lines to an OpenAI server and turn each answer into an output record.

The server is the gateway's own app in-process (httpx's ASGI transport: the very middleware,
admission, validation and serving code an HTTP request goes through, no copy of it) or a
deployment's base URL. 429 and 503 answers are waited out (Retry-After), so a batch yields to
interactive traffic, rate limits and full workers instead of failing its lines.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Awaitable, Callable, Iterable

import httpx

from tessera.batch_jobs.format import BatchLine, error_record, expired_record, line_error, response_record

RETRY_STATUSES = (429, 503)
MAX_WAIT_S = 30.0           # longest pause between two tries of one line
TRANSPORT_RETRIES = 3       # connection failures (a --url deployment restarting) before a line fails


def in_process(app, marker: dict | None = None) -> httpx.AsyncClient:
    """A client that calls `app` (an ASGI app) directly. `marker` entries are added to each
    request's ASGI scope: the gateway uses one to tell its middleware whose batch a line is,
    something no network client can set."""
    async def with_marker(scope, receive, send):
        await app({**scope, **(marker or {})}, receive, send)
    transport = httpx.ASGITransport(app=with_marker, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://tessera/v1", timeout=None)


def remote(base_url: str, api_key: str | None) -> httpx.AsyncClient:
    """A client for a running deployment's OpenAI base URL (http://host:port/v1)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers,
                             timeout=httpx.Timeout(600.0, connect=10.0))


class LineSender:
    """send(line) -> output record. 429/503 answers and connection failures are retried:
    with a `deadline` (wall clock: the job's expiry) until then, and a line not answered by
    then gets a batch_expired record; with `patience_s`, for that long, then the last answer
    (or failure) is kept."""

    def __init__(self, http: httpx.AsyncClient, deadline: float | None = None,
                 patience_s: float | None = None) -> None:
        self.http, self.deadline, self.patience_s = http, deadline, patience_s

    async def __call__(self, line: BatchLine) -> dict:
        if line.problem is not None:
            return line_error(line)
        patience_end = time.time() + (self.patience_s if self.patience_s is not None else math.inf)
        failures = 0
        while True:
            if self.deadline is not None and time.time() >= self.deadline:
                return expired_record(line)
            try:
                # as the line was written: NaN and lone surrogates reach the API, which refuses
                # them (400 for this line); httpx's json= would raise and fail the whole job
                r = await self.http.post(line.url.removeprefix("/v1"), content=json.dumps(line.body),
                                         headers={"content-type": "application/json"})
            except httpx.HTTPError as e:
                failures += 1
                if failures > TRANSPORT_RETRIES or time.time() >= patience_end:
                    return error_record(line.custom_id, "request_failed", f"{type(e).__name__}: {e}", line.line)
                await asyncio.sleep(min(2.0 ** failures, MAX_WAIT_S))
                continue
            wait = _retry_after(r)
            if r.status_code in RETRY_STATUSES and time.time() + wait < patience_end:
                await asyncio.sleep(wait)
                continue
            return response_record(line.custom_id, r.status_code, r.headers.get("x-request-id", ""), _body(r))


def _retry_after(r: httpx.Response) -> float:
    try:
        return min(max(float(r.headers.get("retry-after", 1)), 0.1), MAX_WAIT_S)
    except ValueError:
        return 1.0


def _body(r: httpx.Response):
    try:
        return r.json()
    except ValueError:
        return {"error": {"message": r.text[:2000], "type": "server_error", "param": None, "code": None}}


async def run_lines(lines: Iterable[BatchLine], send: Callable[[BatchLine], Awaitable[dict]], concurrency: int,
                    on_result: Callable[[BatchLine, dict], Awaitable[None]],
                    gate: asyncio.Semaphore | None = None) -> None:
    """send() every line, at most `concurrency` at a time and, with `gate`, within a bound that
    several jobs share; on_result(line, record) as each completes. An exception (e.g. a lost
    lease) stops them all."""
    pending = iter(lines)

    async def worker() -> None:
        for line in pending:
            if gate is None or line.problem is not None:
                record = await send(line)
            else:
                async with gate:
                    record = await send(line)
            await on_result(line, record)

    async with asyncio.TaskGroup() as group:
        for _ in range(concurrency):
            group.create_task(worker())
