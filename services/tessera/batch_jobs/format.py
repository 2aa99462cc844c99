"""OpenAI's batch file format, shared by `tessera run-batch` and the Batch API.

Input: one JSON object a line, {"custom_id", "method": "POST", "url", "body"}. Output: one
record a line, {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}.

Two kinds of fault. A malformed FILE is refused whole (FileError, with its line): not UTF-8,
no line that is a JSON object, a missing or repeated custom_id, an unknown url (or, in the
Batch API, one other than the batch's endpoint), more than MAX_LINES requests. A malformed LINE
(not JSON, method other than POST, body not an object, "stream": true) is never sent: it gets
an error record naming its line number, and the rest of the file runs.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_LINES = 50_000          # OpenAI's limit on requests in one batch


class FileError(ValueError):
    """The whole file is refused; `line` is the 1-based line at fault (None: the file itself)."""

    def __init__(self, message: str, line: int | None = None, code: str = "invalid_file") -> None:
        super().__init__(f"line {line}: {message}" if line else message)
        self.line, self.code, self.reason = line, code, message


@dataclass(frozen=True)
class BatchLine:
    index: int                 # position among the file's request lines (0-based)
    line: int                  # 1-based line number in the file
    custom_id: str | None
    url: str | None
    body: dict | None
    problem: str | None = None    # why the line cannot be sent; None: it can


def parse(data: bytes, endpoint: str | None = None) -> list[BatchLine]:
    """Every non-blank line of a batch file; raises FileError for a malformed file. With
    `endpoint` (the Batch API), every url must be that one."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FileError(f"not a JSONL file: not UTF-8 text (byte {e.start})") from None
    lines: list[BatchLine] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        if raw.strip():
            lines.append(_line(len(lines), number, raw, seen, endpoint))
            if len(lines) > MAX_LINES:
                raise FileError(f"more than {MAX_LINES} requests in one file", number)
    if not any(line.custom_id is not None for line in lines):
        raise FileError("not a JSONL file: no line is a JSON request object"
                        if lines else "the file holds no requests")
    return lines


def _line(index: int, number: int, raw: str, seen: dict[str, int], endpoint: str | None) -> BatchLine:
    try:
        obj = json.loads(raw)
    except ValueError as e:
        return BatchLine(index, number, None, None, None, f"not valid JSON: {e}")
    if not isinstance(obj, dict):
        return BatchLine(index, number, None, None, None, "not a JSON object")
    custom_id, url, body = obj.get("custom_id"), obj.get("url"), obj.get("body")
    if not isinstance(custom_id, str) or not custom_id:
        raise FileError("custom_id is missing (each request needs a unique, non-empty string custom_id)", number)
    if custom_id in seen:
        raise FileError(f"custom_id {custom_id[:64]!r} repeats line {seen[custom_id]}", number, "duplicate_custom_id")
    seen[custom_id] = number
    if url not in ENDPOINTS:
        raise FileError(f"unknown url {str(url)[:64]!r}: expected one of {', '.join(ENDPOINTS)}", number, "invalid_url")
    if endpoint is not None and url != endpoint:
        raise FileError(f"url {url} differs from the batch's endpoint {endpoint}", number, "mismatched_url")
    problem = None
    if obj.get("method") != "POST":
        problem = "method must be POST"
    elif not isinstance(body, dict):
        problem = "body must be a JSON object"
    elif body.get("stream"):
        problem = "stream is not supported in a batch"
    return BatchLine(index, number, custom_id, url, body if isinstance(body, dict) else None, problem)


def response_record(custom_id: str | None, status: int, request_id: str, body) -> dict:
    """The output record of a request that was sent (any HTTP status)."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}


def error_record(custom_id: str | None, code: str, message: str, line: int | None = None) -> dict:
    """The output record of a request that got no HTTP response (never sent, or expired)."""
    error = {"code": code, "message": f"line {line}: {message}" if line else message}
    if line:
        error["line"] = line
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None, "error": error}


def line_error(line: BatchLine) -> dict:
    return error_record(line.custom_id, "invalid_request", line.problem or "", line.line)


def expired_record(line: BatchLine) -> dict:
    return error_record(line.custom_id, "batch_expired", "the batch expired before this request could run")


def succeeded(record: dict) -> bool:
    """Whether a record goes to the output file (2xx) rather than the error file."""
    response = record.get("response")
    return bool(response) and 200 <= response["status_code"] < 300
