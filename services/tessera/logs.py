"""Logging for every Tessera process: one JSON object per line on stderr (TESSERA_LOG_FORMAT=text
for plain lines), level from TESSERA_LOG_LEVEL. The request id travels from the gateway's
X-Request-Id header to the worker in gRPC metadata (x-request-id); a context variable puts it
on every log line written while that request is handled, and, with tracing on (tracing.py), the
trace and span ids of the span current there."""
from __future__ import annotations

import contextvars
import json
import logging
import os
import time
from typing import Callable

request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
trace_ids: Callable[[], tuple[str, str] | None] | None = None    # set by tracing.configure()


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
                "msg": record.getMessage()}
        rid = getattr(record, "request_id", None) or request_id.get()
        if rid:
            line["request_id"] = rid
        ids = trace_ids() if trace_ids is not None else None
        if ids is not None:
            line["trace_id"], line["span_id"] = ids
        line.update(getattr(record, "fields", {}))
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def setup(default_level: str = "INFO") -> None:
    handler = logging.StreamHandler()
    if os.environ.get("TESSERA_LOG_FORMAT", "json") == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=os.environ.get("TESSERA_LOG_LEVEL", default_level).upper(), handlers=[handler],
                        force=True)
    logging.Formatter.converter = time.gmtime


def event(logger: logging.Logger, msg: str, **fields) -> None:
    """An INFO line with structured fields (JSON keys)."""
    logger.info(msg, extra={"fields": fields})
