"""OpenTelemetry traces: one tree per request across the gateway and its worker.

configure() runs once per process at start (cli.py, for the roles in SERVICE_NAMES) and is off
unless --otlp-traces-endpoint or OTEL_EXPORTER_OTLP(_TRACES)_ENDPOINT names a receiver; off,
every helper here returns at its first line. On, spans go through a BatchSpanProcessor to an
OTLP exporter (gRPC, or HTTP/protobuf when OTEL_EXPORTER_OTLP(_TRACES)_PROTOCOL says so) from a
thread of their own: a receiver that is down costs a dropped batch, never a request's time.
The W3C context travels in a `carrier` dict (traceparent, tracestate): as gRPC metadata on a
Generate call, in SessionRequest.trace_context on a session (one stream carries many requests).
Prompts and outputs never go into spans. The detailed level (--trace-level detailed) adds spans
per speculative round, AFD decode step and pipeline micro-batch (tracing_detail.py); it keeps
each worker request's span by request id, so that the engine thread's step spans find its trace.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import socket
import time
import urllib.parse
from dataclasses import dataclass, field

from tessera.config import ConfigError

# `tessera COMMAND` -> service.name (OTEL_SERVICE_NAME overrides it).
SERVICE_NAMES = {c: f"tessera-{c}" for c in ("gateway", "worker", "target-worker", "attention-node", "expert-node",
                                              "draft-worker", "pipeline-shard")}
LEVELS = ("request", "detailed")
RESPONSE_HEADER = "x-trace-id"
EXPORT_TIMEOUT_S = 2.0     # per export, unless OTEL_EXPORTER_OTLP(_TRACES)_TIMEOUT says otherwise
WARN_EVERY_S = 60.0        # an exporter failing without pause says so once a minute, not once a batch

_tracer = None             # set by configure(): tracing is on
_detailed = False         # --trace-level detailed
_request_span: contextvars.ContextVar = contextvars.ContextVar("request_span", default=None)
_worker_spans: dict = {}  # request id -> its worker span, at the detailed level (server_span)


@dataclass(frozen=True)
class TracingConfig:
    otlp_traces_endpoint: str | None = field(default=None, metadata={
        "help": "send OpenTelemetry traces to this OTLP receiver, e.g. http://collector:4317 (default: "
                "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or $OTEL_EXPORTER_OTLP_ENDPOINT; none: tracing off)"})
    trace_replica: int | None = field(default=None, metadata={
        "help": "this process's replica index, a resource attribute of its spans (tessera up sets it)"})
    trace_level: str | None = field(default=None, metadata={
        "choices": LEVELS, "help": "request: spans per request and its phases; detailed: also per speculative "
                                   "round, AFD decode step and pipeline micro-batch (default: request; serve and up "
                                   "hand it to every process)"})


def enabled() -> bool:
    return _tracer is not None


def detailed() -> bool:
    return _detailed


def tracer():
    """This process's tracer (None when off)."""
    return _tracer


def configure(role: str, endpoint: str | None, service_name: str | None = None, replica: int | None = None,
              stage: int | None = None, level: str | None = None) -> bool:
    """Install the TracerProvider of this process, if a receiver is named; False: tracing off."""
    global _tracer, _detailed
    endpoint = endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or \
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    level = level or "request"
    if level not in LEVELS:
        raise ConfigError(f"trace level {level!r}: choose from {', '.join(LEVELS)}", "trace_level")
    if not endpoint:
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        exporter = _exporter(endpoint)
    except ImportError as e:
        raise ConfigError(f"--otlp-traces-endpoint: the OpenTelemetry packages are missing ({e}); "
                          "pip install opentelemetry-sdk opentelemetry-exporter-otlp") from None
    attributes = {"service.name": os.environ.get("OTEL_SERVICE_NAME") or service_name or f"tessera-{role}",
                  "service.namespace": "tessera", "service.instance.id": f"{socket.gethostname()}:{os.getpid()}",
                  "tessera.role": role}
    if replica is not None:
        attributes["tessera.replica"] = replica
    if stage is not None:
        attributes["tessera.stage"] = stage
    provider = TracerProvider(resource=Resource.create(attributes))   # sampler: OTEL_TRACES_SAMPLER(_ARG)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _tracer = provider.get_tracer("tessera")
    _detailed = level == "detailed"
    for name in ("opentelemetry.exporter.otlp.proto.grpc.exporter", "opentelemetry.exporter.otlp.proto.http",
                 "opentelemetry.exporter.otlp.proto.http.trace_exporter", "opentelemetry.sdk.trace.export"):
        logging.getLogger(name).addFilter(_Sparse())
    from tessera import logs
    logs.trace_ids = current_ids
    return True


def _exporter(endpoint: str):
    """gRPC (OTLP's default), or HTTP/protobuf; an endpoint from the flag is used as given
    (HTTP: /v1/traces added when it has no path), one from the environment as the exporter reads it."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or \
        os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    given = endpoint if endpoint not in (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
                                         os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")) else None
    timeout = None if os.environ.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT") or \
        os.environ.get("OTEL_EXPORTER_OTLP_TIMEOUT") else EXPORT_TIMEOUT_S
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter(endpoint=given, timeout=timeout)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
        if given and urllib.parse.urlsplit(given).path in ("", "/"):
            given = given.rstrip("/") + "/v1/traces"
        return HttpExporter(endpoint=given, timeout=timeout)
    raise ConfigError(f"OTLP protocol {protocol!r}: tessera exports traces over grpc or http/protobuf")


class _Sparse(logging.Filter):
    """Let through one warning per WARN_EVERY_S: a receiver that is down fails every batch."""

    def __init__(self) -> None:
        super().__init__()
        self.last = -WARN_EVERY_S

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        now = time.monotonic()
        if now - self.last < WARN_EVERY_S:
            return False
        self.last = now
        return True


def current_ids() -> tuple[str, str] | None:
    """(trace id, span id) in hex of the span current here, for log lines."""
    from opentelemetry import trace
    ctx = trace.get_current_span().get_span_context()
    return (f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}") if ctx.is_valid else None


# --- the gateway --------------------------------------------------------------------------


@contextlib.contextmanager
def request_span(name: str, carrier: dict, attributes: dict):
    """The gateway's SERVER span of one HTTP request, current inside the block, continuing the
    client's traceparent and tracestate in carrier (a malformed one starts a new trace).
    Yields it (None when off)."""
    if _tracer is None:
        yield None
        return
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    parent = TraceContextTextMapPropagator().extract(carrier) if carrier else None
    with _tracer.start_as_current_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes) as span:
        token = _request_span.set(span)
        try:
            yield span
        finally:
            _request_span.reset(token)


def trace_id(span) -> str | None:
    ctx = span.get_span_context() if span is not None else None
    return f"{ctx.trace_id:032x}" if ctx is not None and ctx.is_valid else None


@contextlib.contextmanager
def span(name: str, **attributes):
    """An INTERNAL span, current inside the block (nothing when off)."""
    if _tracer is None:
        yield None
        return
    with _tracer.start_as_current_span(name, attributes=attributes) as s:
        yield s


def record_usage(usage: dict, finish_reasons: list) -> dict:
    """The response's usage as GenAI attributes of the request's span; returns usage."""
    s = _request_span.get() if _tracer is not None else None
    if s is not None and s.is_recording():
        s.set_attributes({"gen_ai.usage.input_tokens": usage["prompt_tokens"],
                          "gen_ai.usage.output_tokens": usage["completion_tokens"],
                          "gen_ai.response.finish_reasons": [str(r) for r in finish_reasons]})
    return usage


def event(name: str, **attributes) -> None:
    """An event on the current span (a failover's cut)."""
    if _tracer is not None:
        from opentelemetry import trace
        trace.get_current_span().add_event(name, attributes)


def client_span(name: str, address: str):
    """(span, carrier): a CLIENT span for one call to a worker, not current (it lives across an
    async generator's awaits), and the W3C headers that make the worker's spans its children."""
    if _tracer is None:
        return None, {}
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    host, _, port = address.rpartition(":")
    s = _tracer.start_span(name, kind=SpanKind.CLIENT, attributes={
        "rpc.system": "grpc", "server.address": host, "server.port": int(port) if port.isdigit() else 0,
        "tessera.worker.address": address})
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(s))
    return s, carrier


def set_error(s, description: str) -> None:
    from opentelemetry.trace import Status, StatusCode
    s.set_status(Status(StatusCode.ERROR, description))


def end(s, error: BaseException | None = None) -> None:
    if s is None:
        return
    if error is not None:
        set_error(s, f"{type(error).__name__}: {error}")
    s.end()


# --- the worker ---------------------------------------------------------------------------


def server_span(name: str, carrier: dict, **attributes):
    """The worker's SERVER span of one request, child of the gateway's call (carrier), made
    current for the rest of this task (each request runs in a task of its own, as
    logs.request_id): its log lines carry its ids. At the detailed level it is kept under its
    `tessera.request_id` attribute (the engine's request id) until end_generation, for the
    step spans of tracing_detail.py. None when off."""
    if _tracer is None:
        return None
    from opentelemetry import context, trace
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    parent = TraceContextTextMapPropagator().extract(carrier) if carrier else None
    s = _tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)
    context.attach(trace.set_span_in_context(s))
    request_id = attributes.get("tessera.request_id")
    if _detailed and request_id and s.is_recording():
        _worker_spans[request_id] = s
    return s


def worker_span(request_id: str):
    """The recording worker span of an engine request, at the detailed level (else None)."""
    return _worker_spans.get(request_id) if _detailed else None


def end_generation(s, last, prompt_tokens: int | None, output_tokens: int, finish: str | None,
                   error: BaseException | None = None) -> None:
    """End the worker's span, with its phases as child spans placed by the engine's own timings
    (the last chunk's: queue, prefill, decode, each a duration ending now): no span per token."""
    if s is None:
        return
    if _worker_spans and s.is_recording():   # only recording spans were kept
        _worker_spans.pop(s.attributes.get("tessera.request_id"), None)
    s.set_attributes({"gen_ai.usage.input_tokens": prompt_tokens or 0, "gen_ai.usage.output_tokens": output_tokens})
    if finish:
        s.set_attribute("gen_ai.response.finish_reasons", [finish])
    timings = getattr(last, "timings", None)
    if timings is not None:
        from opentelemetry import trace
        parent = trace.set_span_in_context(s)
        t_end = time.time_ns()
        t_decode = t_end - int(timings.decode_time_s * 1e9)
        t_prefill = t_decode - int(timings.prefill_time_s * 1e9)
        t_queue = t_prefill - int(timings.queue_time_s * 1e9)
        phases = (("queue", t_queue, t_prefill, {}),
                  ("prefill", t_prefill, t_decode, {"gen_ai.usage.input_tokens": prompt_tokens or 0,
                                                    "tessera.cached_tokens": last.cached_tokens}),
                  ("decode", t_decode, t_end, {"gen_ai.usage.output_tokens": output_tokens}))
        for name, start, stop, attributes in phases:
            _tracer.start_span(name, context=parent, start_time=start, attributes=attributes).end(end_time=stop)
    end(s, error)


# --- gRPC calls between the roles (the detailed level) --------------------------------------


def outgoing_metadata() -> tuple:
    """gRPC metadata making the callee's spans children of the span current here: the target's
    round calls to its draft worker, at the detailed level (else nothing)."""
    if not _detailed:
        return ()
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return tuple(carrier.items())


@contextlib.contextmanager
def rpc_span(name: str, metadata, **attributes):
    """A SERVER span of one gRPC call, current inside the block, when the caller sent a
    traceparent in metadata (it traces at the detailed level); else nothing is recorded.
    attributes are named without the `tessera.` prefix. Yields the span or None."""
    if _tracer is None:
        yield None
        return
    carrier = {k: v for k, v in (metadata or ()) if k in ("traceparent", "tracestate")}
    if "traceparent" not in carrier:
        yield None
        return
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    parent = TraceContextTextMapPropagator().extract(carrier)
    with _tracer.start_as_current_span(name, context=parent, kind=SpanKind.SERVER,
                                       attributes={f"tessera.{k}": v for k, v in attributes.items()}) as s:
        yield s
