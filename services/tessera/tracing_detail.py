"""The detailed trace level (--trace-level detailed): spans of the engine steps that serve many
requests at once (an AFD decode step, a pipeline step) and of the work they cause in other
processes (expert nodes, later pipeline stages, a draft worker's expansions).

Whose trace a step joins: a step runs several requests and a span has one parent. A step's span
is the child of the worker span (tracing.worker_span) of the first request, in the plan's order,
that is traced, with a span link to the worker span of every other traced request of the step;
a step that runs no traced request records nothing. Work in other processes joins the step:
the W3C context travels on the M2N messages as WORDS int64 words (`words`: trace id high and low
halves, span id, trace flags; all zero: none; tracestate is not carried), and the receiving
process records its spans under it (`remote`) whenever it traces at all: the sender's level
decides. Child spans are recorded after the fact from the time.perf_counter() stamps the step
loops take (`StepTrace.record`). Off, or at the request level, `step` yields None at its first
line and the loops skip every trace call.
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterator

from tessera import tracing

WORDS = 4
NONE = (0,) * WORDS
_MASK = (1 << 64) - 1


class StepTrace:
    """A span and the children recorded under it; attributes are named without `tessera.`."""

    def __init__(self, span) -> None:
        from opentelemetry import trace
        self.span = span
        self._parent = trace.set_span_in_context(span)
        self._tracer = tracing.tracer()
        self._offset = time.time_ns() - time.perf_counter_ns()

    def record(self, name: str, t0: float, t1: float, **attributes) -> None:
        """A finished child span from t0 to t1 (time.perf_counter() seconds)."""
        self._tracer.start_span(name, context=self._parent, start_time=int(t0 * 1e9) + self._offset,
                                attributes=_named(attributes)).end(end_time=int(t1 * 1e9) + self._offset)

    def producer(self, name: str, **attributes):
        """A PRODUCER child started now: a transfer whose message carries its `words`; end() it
        once sent (tracing.end)."""
        from opentelemetry.trace import SpanKind
        return self._tracer.start_span(name, context=self._parent, kind=SpanKind.PRODUCER,
                                       attributes=_named(attributes))

    def words(self) -> tuple[int, ...]:
        return words(self.span)


def _named(attributes: dict) -> dict:
    return {f"tessera.{k}": v for k, v in attributes.items()}


@contextlib.contextmanager
def step(name: str, plan, **attributes) -> Iterator[StepTrace | None]:
    """The span of one engine step over `plan` (scheduler.StepPlan), in the trace of its first
    traced request and linked to the others (see the module docstring); None when not detailed
    or when the step runs no traced request. Ended with the block's error, if any."""
    if not tracing.detailed():
        yield None
        return
    spans = [s for s in (tracing.worker_span(e.request_id) for e in plan.scheduled) if s is not None]
    if not spans:
        yield None
        return
    from opentelemetry import trace
    from opentelemetry.trace import Link
    links = [Link(s.get_span_context()) for s in spans[1:]]
    span = tracing.tracer().start_span(name, context=trace.set_span_in_context(spans[0]), links=links,
                                       attributes=_named({**attributes, "requests": len(plan.scheduled)}))
    with _ended(span):
        yield StepTrace(span)


@contextlib.contextmanager
def remote(name: str, context: tuple[int, ...] | None, **attributes) -> Iterator[StepTrace | None]:
    """A CONSUMER span of work a message asked for, under the context it carried (`words`);
    None when this process does not trace or the message carried none."""
    if not tracing.enabled() or not context or not context[2]:
        yield None
        return
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind
    hi, lo, span_id, flags = (int(w) & _MASK for w in context)
    parent = trace.SpanContext((hi << 64) | lo, span_id, is_remote=True, trace_flags=trace.TraceFlags(flags & 0xFF))
    if not parent.is_valid:
        yield None
        return
    span = tracing.tracer().start_span(name, context=trace.set_span_in_context(trace.NonRecordingSpan(parent)),
                                       kind=SpanKind.CONSUMER, attributes=_named(attributes))
    with _ended(span):
        yield StepTrace(span)


@contextlib.contextmanager
def _ended(span):
    error = None
    try:
        yield
    except BaseException as e:
        error = e
        raise
    finally:
        tracing.end(span, error if isinstance(error, Exception) else None)


def current() -> StepTrace | None:
    """The span current here, when it records: later work it caused is recorded under it."""
    if not tracing.enabled():
        return None
    from opentelemetry import trace
    span = trace.get_current_span()
    return StepTrace(span) if span.is_recording() else None


def words(span) -> tuple[int, ...]:
    """A span's W3C context as WORDS int64s for a message (NONE for no span)."""
    if span is None:
        return NONE
    ctx = span.get_span_context()
    return tuple(_signed(v) for v in (ctx.trace_id >> 64, ctx.trace_id & _MASK, ctx.span_id, int(ctx.trace_flags)))


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v
