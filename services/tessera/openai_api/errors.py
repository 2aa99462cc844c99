"""OpenAI's error envelope: {"error": {"message", "type", "param", "code"}} with its status."""
from __future__ import annotations

import re

from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}
_MEMBER = re.compile(r"[a-z-]+\[.*\]$")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def error_response(e: APIError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after is not None else None
    return JSONResponse(error_body(e.status, e.message, e.param, e.code), status_code=e.status,
                        headers=headers)


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """The first pydantic error as (message, param), e.g. ("max_tokens: Input should be ...", "max_tokens")."""
    if not errors:
        return "invalid request", None
    err = errors[0]
    # pydantic names the union member that failed ("function-after[_unicode(), str]"): not the
    # caller's business; a dict key it names is the caller's own text, so it is cut short
    loc = [str(p)[:32] for p in err.get("loc", ()) if p != "body" and not _MEMBER.match(str(p))]
    if err.get("type") == "json_invalid":
        return f"request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}", None
    param = loc[0] if loc else None
    where = ".".join(loc)
    return (f"{where}: {err.get('msg')}" if where else str(err.get("msg"))), param
