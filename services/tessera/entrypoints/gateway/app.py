"""OpenAI-compatible HTTP gateway (FastAPI) in front of one WorkerClient.

Routes: GET /v1/models, POST /v1/chat/completions and /v1/completions (JSON or SSE),
/v1/responses (responses_routes.py), POST /tokenize and /detokenize (tokenize_routes.py),
GET /health (deep: one token through the engine loop), /health/live (the process answers),
/health/ready (a worker answers), GET /metrics (Prometheus); with batch=..., OpenAI's Files and
Batch APIs (/v1/files, /v1/batches: batch_api.py).
All OpenAI logic lives in tessera.openai_api, admission (body size, API keys, rate limits,
in-flight bound) in admission.py; this module wires them to HTTP.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from tessera import logs
from tessera.config import SamplingParams
from tessera.entrypoints.gateway.admission import Admission, AdmissionConfig, Ticket
from tessera.entrypoints.gateway.responses import chat_body, completion_body
from tessera.entrypoints.gateway.responses_routes import add_responses_routes
from tessera.entrypoints.gateway.tokenize_routes import PATHS as TOKENIZE_PATHS, add_tokenize_routes
from tessera.entrypoints.gateway.trace_middleware import NATIVE_TELEMETRY_OFF, TraceMiddleware
from tessera.generation_defaults import GenerationDefaults
from tessera.metrics import GatewayMetrics
from tessera.openai_api.errors import APIError, error_body, error_response, validation_message
from tessera.openai_api.params import chat_inputs, completion_inputs
from tessera.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from tessera.openai_api.serving import StreamShape, collect, sse_lines, start, stream
from tessera.openai_api.tools import tool_plan
from tessera.worker_api import GenerateInput, WorkerClient, WorkerError, WorkerInfo

HEALTH_TIMEOUT_S = 30.0
READY_TIMEOUT_S = 2.0
# ASGI scope entry of a batch line this gateway sends itself (batch_api.py): the job owner's
# key, already checked when the job was created. No network client can set a scope entry.
BATCH_KEY_SCOPE = "tessera.batch_key"
access_log = logging.getLogger("tessera.gateway")


def create_app(client: WorkerClient, model_name: str, background=(), admission: Admission | None = None,
               batch=None) -> FastAPI:
    """background: coroutine functions run while the app serves (e.g. following the registry);
    batch: the Files and Batch APIs (entrypoints/gateway/batch_api.py), or None."""
    admission = admission or Admission(AdmissionConfig())
    if batch is not None:
        background = (*background, lambda: batch.run(app))

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        tasks = [asyncio.create_task(job()) for job in background]
        yield
        for task in tasks:
            task.cancel()
        await admission.close()

    app = FastAPI(title="Tessera", version="0.1.0", lifespan=lifespan, **NATIVE_TELEMETRY_OFF)
    metrics = GatewayMetrics(model_name)
    app.state.client, app.state.metrics, app.state.admission = client, metrics, admission
    _add_middleware_and_errors(app, metrics, admission, batch.body_limits if batch is not None else {})
    app.add_middleware(TraceMiddleware, model_name=model_name)   # outermost: the access log line is in its span
    _add_openai_routes(app, client, metrics, model_name, admission, _Defaults(client))
    add_responses_routes(app, batch)
    add_tokenize_routes(app, client, model_name, admission)
    if batch is not None:
        app.include_router(batch.router)
    _add_ops_routes(app, client, metrics, admission)
    return app


class RequestIdMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware, whose wrapped receive channel can hand a streaming
    response a spurious http.disconnect). Gives every request a unique internal id (the
    engine's; a client's X-Request-Id is kept for logs and echoed, never used as an id, so two
    clients sending the same one cannot collide), counts /v1/ responses by status, writes one
    access-log line per request, refuses bodies larger than max_body_bytes with 413 (by
    Content-Length, or while a chunked body arrives), then checks the API key on /v1/,
    /tokenize, /detokenize and /health (401) before any route validates the body or looks up
    the model. Paths in body_limits (uploads) have their own limit, which their route enforces
    as it streams."""

    def __init__(self, app, metrics: GatewayMetrics, admission: Admission, body_limits: dict[str, int]) -> None:
        self.app, self.metrics, self.admission, self.body_limits = app, metrics, admission, body_limits

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        rid = uuid.uuid4().hex
        # printable ASCII only: it travels on in gRPC metadata and log lines
        client_rid = re.sub(r"[^!-~]", "", headers.get(b"x-request-id", b"").decode("latin-1"))[:128] or rid
        scope.setdefault("state", {})["request_id"] = rid
        logs.request_id.set(client_rid)
        path = scope.get("path", "")
        counted, t0, status = path.startswith("/v1/"), time.monotonic(), [0]
        limit = self.body_limits.get(path, self.admission.config.max_body_bytes)

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = dict(message, headers=[*message.get("headers", []),
                                                 (b"x-request-id", client_rid.encode("latin-1"))])
                if counted:
                    self.metrics.count(message["status"])
            await send(message)

        try:
            length = headers.get(b"content-length")
            if length is None and scope.get("method") in ("POST", "PUT", "PATCH") and path not in self.body_limits:
                receive, too_large = await _buffer_body(receive, limit)   # chunked: read it first
            else:
                too_large = int(length or 0) > limit   # the server holds the body to its Content-Length
            refusal = self._too_large(limit) if too_large else await self._authenticate(scope, headers, path)
            if refusal is not None:
                await error_response(refusal)(scope, receive, send_with_id)
            else:
                await self.app(scope, receive, send_with_id)
        finally:
            if counted:
                logs.event(access_log, "request", method=scope.get("method"), path=path, status=status[0],
                           duration_ms=round((time.monotonic() - t0) * 1000, 1))

    async def _authenticate(self, scope, headers: dict, path: str) -> APIError | None:
        if not (path.startswith("/v1/") or path == "/health" or path in TOKENIZE_PATHS):
            return None
        if BATCH_KEY_SCOPE in scope:
            scope["state"]["api_key"] = scope[BATCH_KEY_SCOPE]
            return None
        peer = (scope.get("client") or ("unknown",))[0]
        forwarded = headers.get(b"x-forwarded-for", b"").decode("latin-1") or None
        client = self.admission.client_address(peer, forwarded)
        authorization = headers.get(b"authorization", b"").decode("latin-1") or None
        try:
            scope["state"]["api_key"] = await self.admission.authenticate(authorization, client)
        except APIError as e:
            return e
        return None

    def _too_large(self, limit: int) -> APIError:
        return self.admission.reject(413, f"Request body larger than {limit} bytes.", "request_too_large")


async def _buffer_body(receive, limit: int):
    """Read a body sent without Content-Length, up to limit bytes; return a receive() that
    replays it, and whether it was larger than the limit."""
    messages, size = [], 0
    while True:
        message = await receive()
        messages.append(message)
        size += len(message.get("body", b""))
        if size > limit or message["type"] != "http.request" or not message.get("more_body"):
            break
    replay = iter(messages)

    async def replayed():
        return next(replay, None) or await receive()
    return replayed, size > limit


def _add_middleware_and_errors(app: FastAPI, metrics: GatewayMetrics, admission: Admission,
                               body_limits: dict[str, int]) -> None:
    app.add_middleware(RequestIdMiddleware, metrics=metrics, admission=admission, body_limits=body_limits)

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


class _Metered:
    """The shared client as one admitted request sees it: counts the tokens it uses."""

    def __init__(self, client: WorkerClient, ticket: Ticket) -> None:
        self.client, self.ticket = client, ticket

    async def generate(self, request: GenerateInput):
        first = True
        async for chunk in self.client.generate(request):
            self.ticket.tokens += len(chunk.token_ids) + (chunk.prompt_tokens if first else 0)
            first = False
            yield chunk

    async def abort(self, request_id: str) -> None:
        await self.client.abort(request_id)


class _Defaults:
    """What the workers' Info reply says a request needs (sampling defaults, the tool-call
    parser), asked once of the first that answers: the replicas behind one gateway serve one
    model, started alike. Until one answers, none (a request then fails at the worker anyway)."""

    def __init__(self, client: WorkerClient) -> None:
        self.client, self.known = client, None

    async def info(self) -> WorkerInfo | None:
        if self.known is None:
            try:
                self.known = await self.client.info(timeout_s=READY_TIMEOUT_S)
            except WorkerError:
                return None
        return self.known

    async def get(self) -> GenerationDefaults:
        info = await self.info()
        return info.generation_defaults if info is not None else GenerationDefaults()

    async def tool_call_parser(self) -> str:
        info = await self.info()
        return info.tool_call_parser if info is not None else ""


def _add_openai_routes(app: FastAPI, client: WorkerClient, metrics: GatewayMetrics, model_name: str,
                       admission: Admission, defaults: _Defaults) -> None:
    async def check_model(model: str) -> None:
        if model != model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "tessera"}]}

    async def run_chat(body: ChatCompletionRequest, request: Request):
        """A chat request run to its end (the response body), or started as a stream (an async
        iterator of chunk dicts): the route's work, which the Responses API reuses."""
        await check_model(body.model)
        rid = request.state.request_id
        tools = tool_plan(body, await defaults.tool_call_parser())
        inputs = chat_inputs(body, rid, admission.rules(getattr(request.state, "api_key", None)),
                             await defaults.get(), tools)
        if body.stream:
            shape = StreamShape(f"chatcmpl-{rid}", model_name, True, _usage(body), body.logprobs, body.n, tools=tools)
            return await _stream(request, inputs, shape)
        return chat_body(rid, model_name, await _collect(request, inputs), body.logprobs, tools)

    app.state.run_chat = run_chat

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        result = await run_chat(body, request)
        return _sse(result) if body.stream else result

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        await check_model(body.model)
        rid = request.state.request_id
        inputs = completion_inputs(body, rid, admission.config.max_choices,
                                   admission.rules(getattr(request.state, "api_key", None)), await defaults.get())
        logprobs = body.logprobs is not None
        if body.stream:
            shape = StreamShape(f"cmpl-{rid}", model_name, False, _usage(body), logprobs, body.n)
            return _sse(await _stream(request, inputs, shape))
        choices = await _collect(request, inputs)
        echo = [i.text or "" for i in inputs[::body.n]] if body.echo else None
        return completion_body(rid, model_name, choices, body.n, logprobs, echo)

    async def _collect(request: Request, inputs: list[GenerateInput]):
        """Admit, then run every choice to its end; the admission ticket is released however
        the request ends (a client that leaves aborts it)."""
        ticket = await admission.admit(getattr(request.state, "api_key", None), len(inputs))
        try:
            return await _until_disconnect(request, collect(_Metered(client, ticket), inputs, metrics))
        finally:
            ticket.release()

    async def _stream(request: Request, inputs: list[GenerateInput], shape: StreamShape):
        """Admit and wait for the first event (an error up front is still an HTTP error); the
        chunks that follow release the ticket when they end, however they end."""
        ticket = await admission.admit(getattr(request.state, "api_key", None), len(inputs))
        try:
            first, events = await start(_Metered(client, ticket), inputs, metrics)
        except BaseException:
            ticket.release()
            raise
        return _released(stream(first, events, len(inputs), shape), ticket)


def _sse(chunks) -> StreamingResponse:
    return StreamingResponse(sse_lines(chunks), media_type="text/event-stream")


async def _released(events, ticket: Ticket):
    try:
        async for event in events:
            yield event
    finally:
        ticket.release()


def _add_ops_routes(app: FastAPI, client: WorkerClient, metrics: GatewayMetrics, admission: Admission) -> None:
    @app.get("/health/live")
    async def live():
        """Liveness: this process and its event loop answer (no worker involved)."""
        return {"status": "ok"}

    @app.get("/health/ready")
    async def ready():
        """Readiness: at least one worker answers, so a request routed here can be served."""
        try:
            await client.info(timeout_s=READY_TIMEOUT_S)
        except (WorkerError, asyncio.TimeoutError) as e:
            return JSONResponse({"status": "not ready", "error": str(e) or "timeout"}, status_code=503)
        return {"status": "ready"}

    @app.get("/health")
    async def health():
        """Deep health: one greedy token through the worker's engine loop, with a deadline."""
        probe = GenerateInput(f"health-{uuid.uuid4().hex[:8]}", SamplingParams(temperature=0, max_tokens=1),
                              token_ids=(0,))
        ticket = admission.hold()     # a probe runs an engine step: bounded like any request
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(collect(client, [probe], None), HEALTH_TIMEOUT_S)
        except (asyncio.TimeoutError, WorkerError) as e:
            return JSONResponse({"status": "unhealthy", "error": str(e) or "timeout"}, status_code=503)
        finally:
            ticket.release()
        return {"status": "ok", "engine_roundtrip_s": round(time.monotonic() - t0, 4)}

    @app.get("/metrics")
    async def prometheus(request: Request):
        info: WorkerInfo | None = None
        try:
            info = await client.info()
        except WorkerError:
            pass
        pool = client if hasattr(client, "failovers") else None
        body, content_type = metrics.render(info, pool, admission, request.headers.get("accept", ""))
        return Response(body, media_type=content_type)


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
