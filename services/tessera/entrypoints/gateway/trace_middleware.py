"""The gateway's request span (tracing.py), as the outermost ASGI middleware: it continues the
client's W3C traceparent (a malformed one starts a new trace), is current while the request is
admitted, routed and answered (so the access log line and the worker call are inside it), and
returns its trace id in the x-trace-id response header. Off (no receiver), it passes through."""
from __future__ import annotations

import inspect
import re

from fastapi import FastAPI

from tessera import tracing

# Fixed routes keep their path in the span name; others (/v1/files/ID, ...) are named by method only.
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/v1/files", "/v1/batches",
          "/tokenize", "/detokenize", "/health")
OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion", "/v1/responses": "chat"}
# FastAPI from 0.165 traces by itself once a TracerProvider is set: a second SERVER span per
# request, beside ours (it does not see our parent), and spans for probes and scrapes. Ours
# carries the GenAI attributes and the x-trace-id header, so FastAPI's is turned off where it exists.
NATIVE_TELEMETRY_OFF = {"telemetry": {"tracing": False, "metrics": False, "logs": False}} \
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {}
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


class TraceMiddleware:
    def __init__(self, app, model_name: str) -> None:
        self.app, self.model_name = app, model_name

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not tracing.enabled() or not (path.startswith("/v1/") or path in ROUTES):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        parent = headers.get(b"traceparent", b"").decode("latin-1").strip().lower()
        method = scope.get("method", "GET")
        attributes = {"http.request.method": method, "url.path": path, "gen_ai.request.model": self.model_name}
        if path in ROUTES:
            attributes["http.route"] = path
        if path in OPERATIONS:
            attributes["gen_ai.operation.name"] = OPERATIONS[path]
        name = f"{method} {path}" if path in ROUTES else method
        # the propagator also refuses a bad header; the check here keeps it from logging each one
        carrier = {"traceparent": parent, "tracestate": headers.get(b"tracestate", b"").decode("latin-1")[:512]} \
            if _TRACEPARENT.fullmatch(parent) else {}
        with tracing.request_span(name, carrier, attributes) as span:
            trace_id = (tracing.trace_id(span) or "").encode()

            async def send_with_trace(message) -> None:
                if message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", message["status"])
                    if message["status"] >= 500:
                        tracing.set_error(span, f"HTTP {message['status']}")
                    message = dict(message, headers=[*message.get("headers", []),
                                                     (tracing.RESPONSE_HEADER.encode(), trace_id)])
                await send(message)
            await self.app(scope, receive, send_with_trace)
