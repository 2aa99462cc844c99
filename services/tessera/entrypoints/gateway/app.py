"""OpenAI-compatible HTTP gateway (FastAPI) in front of one WorkerClient.

Routes: GET /v1/models, POST /v1/chat/completions and /v1/completions (JSON or SSE),
GET /health (deep: one token through the engine loop), GET /metrics (Prometheus).
All OpenAI logic lives in tessera.openai_api; this module wires it to HTTP.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from tessera.config import SamplingParams
from tessera.entrypoints.gateway.responses import chat_body, completion_body
from tessera.metrics import GatewayMetrics
from tessera.openai_api.errors import APIError, error_body, error_response, validation_message
from tessera.openai_api.params import chat_inputs, completion_inputs
from tessera.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from tessera.openai_api.serving import StreamShape, collect, start, stream
from tessera.worker_api import GenerateInput, WorkerClient, WorkerError, WorkerInfo

HEALTH_TIMEOUT_S = 30.0


def create_app(client: WorkerClient, model_name: str, background=()) -> FastAPI:
    """background: coroutine functions run while the app serves (e.g. following the registry)."""
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        tasks = [asyncio.create_task(job()) for job in background]
        yield
        for task in tasks:
            task.cancel()

    app = FastAPI(title="Tessera", version="0.1.0", lifespan=lifespan)
    metrics = GatewayMetrics(model_name)
    app.state.client, app.state.metrics = client, metrics
    _add_middleware_and_errors(app, metrics)
    _add_openai_routes(app, client, metrics, model_name)
    _add_ops_routes(app, client, metrics)
    return app


class RequestIdMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware, whose wrapped receive channel can hand a streaming
    response a spurious http.disconnect): reads or makes X-Request-Id, echoes it, and counts
    /v1/ responses by status."""

    def __init__(self, app, metrics: GatewayMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
        rid = given or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        counted = scope.get("path", "").startswith("/v1/")

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", []),
                                                 (b"x-request-id", rid.encode("latin-1"))])
                if counted:
                    self.metrics.count(message["status"])
            await send(message)

        await self.app(scope, receive, send_with_id)


def _add_middleware_and_errors(app: FastAPI, metrics: GatewayMetrics) -> None:
    app.add_middleware(RequestIdMiddleware, metrics=metrics)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        message, param = validation_message(list(exc.errors()))
        return error_response(APIError(400, message, param))

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(WorkerError)
    async def on_worker_error(request: Request, exc: WorkerError):
        retry = 1 if exc.status == 503 else None
        return error_response(APIError(exc.status, str(exc), exc.param, exc.code, retry))

    @app.exception_handler(HTTPException)
    async def on_http(request: Request, exc: HTTPException):
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)


def _add_openai_routes(app: FastAPI, client: WorkerClient, metrics: GatewayMetrics, model_name: str) -> None:
    async def check_model(model: str) -> None:
        if model != model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "tessera"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        await check_model(body.model)
        rid = request.state.request_id
        inputs = chat_inputs(body, rid)
        if body.stream:
            shape = StreamShape(f"chatcmpl-{rid}", model_name, True, _usage(body), body.logprobs, body.n)
            return await _sse(inputs, shape)
        choices = await _until_disconnect(request, collect(client, inputs, metrics))
        return chat_body(rid, model_name, choices, body.logprobs)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        await check_model(body.model)
        rid = request.state.request_id
        inputs = completion_inputs(body, rid)
        logprobs = body.logprobs is not None
        if body.stream:
            shape = StreamShape(f"cmpl-{rid}", model_name, False, _usage(body), logprobs, body.n)
            return await _sse(inputs, shape)
        choices = await _until_disconnect(request, collect(client, inputs, metrics))
        echo = [i.text or "" for i in inputs[::body.n]] if body.echo else None
        return completion_body(rid, model_name, choices, body.n, logprobs, echo)

    async def _sse(inputs: list[GenerateInput], shape: StreamShape) -> StreamingResponse:
        first, events = await start(client, inputs, metrics)
        return StreamingResponse(stream(first, events, len(inputs), shape), media_type="text/event-stream")


def _add_ops_routes(app: FastAPI, client: WorkerClient, metrics: GatewayMetrics) -> None:
    @app.get("/health")
    async def health():
        """Deep health: one greedy token through the worker's engine loop, with a deadline."""
        probe = GenerateInput(f"health-{uuid.uuid4().hex[:8]}", SamplingParams(temperature=0, max_tokens=1),
                              token_ids=(0,))
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(collect(client, [probe], None), HEALTH_TIMEOUT_S)
        except (asyncio.TimeoutError, WorkerError) as e:
            return JSONResponse({"status": "unhealthy", "error": str(e) or "timeout"}, status_code=503)
        return {"status": "ok", "engine_roundtrip_s": round(time.monotonic() - t0, 4)}

    @app.get("/metrics")
    async def prometheus():
        info: WorkerInfo | None = None
        try:
            info = await client.info()
        except WorkerError:
            pass
        return Response(metrics.render(info, client if hasattr(client, "failovers") else None), media_type="text/plain; version=0.0.4")


def _usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


async def _until_disconnect(request: Request, work):
    """Await `work`, cancelling it (which aborts the worker requests) if the client leaves."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            raise APIError(499, "client disconnected")
