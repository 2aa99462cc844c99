"""A streaming multipart/form-data reader for /v1/files uploads: text fields are returned,
the one file part's bytes go to a sink as they arrive, so an upload never sits in memory
whole. (Starlette's form parsing needs python-multipart, which Tessera does not depend on.)"""
from __future__ import annotations

import re
from typing import AsyncIterator, Callable

MAX_HEADERS = 16 << 10      # bytes of one part's headers
MAX_FIELD = 4 << 10         # bytes of one text field


class FormError(ValueError):
    pass


def boundary_of(content_type: str) -> bytes:
    m = re.search(r'boundary="?([^";]{1,200})"?', content_type or "")
    if not content_type.lower().startswith("multipart/form-data") or m is None:
        raise FormError("expected a multipart/form-data body with a boundary")
    return m[1].encode("latin-1")


def _disposition(headers: bytes) -> tuple[str, str | None]:
    """(field name, file name or None) from a part's Content-Disposition header."""
    text = headers.decode("utf-8", "replace")
    line = next((h for h in text.split("\r\n") if h.lower().startswith("content-disposition:")), None)
    name = re.search(r'\bname="([^"]*)"', line or "")
    if name is None:
        raise FormError("a form part has no Content-Disposition name")
    filename = re.search(r'\bfilename="([^"]*)"', line or "")
    return name[1], (filename[1] if filename else None)


def _start_part(headers: bytes, fields: dict[str, bytearray], filename: str | None) -> tuple[str, str | None, bool]:
    """A new part: (its name, the upload's file name, whether this part is the file)."""
    name, part_file = _disposition(headers)
    if part_file is None:
        fields[name] = bytearray()
        return name, filename, False
    if filename is not None:
        raise FormError("only one file may be uploaded at a time")
    return name, part_file, True


async def read_form(chunks: AsyncIterator[bytes], content_type: str,
                    sink: Callable[[bytes], None]) -> tuple[dict[str, str], str | None]:
    """(text fields, file name of the file part); the file part's bytes went to sink()."""
    delimiter = b"\r\n--" + boundary_of(content_type)
    buf, filename = b"\r\n", None     # the leading CRLF lets the first delimiter match
    fields: dict[str, bytearray] = {}
    state, name = "preamble", None
    async for chunk in chunks:
        buf += chunk
        while True:
            if state == "preamble":
                at = buf.find(delimiter)
                if at < 0:
                    buf = buf[-len(delimiter):]
                    break
                buf, state = buf[at + len(delimiter):], "after_delimiter"
            elif state == "after_delimiter":
                if len(buf) < 2:
                    break
                if buf[:2] == b"--":
                    return {k: v.decode("utf-8", "replace") for k, v in fields.items()}, filename
                buf, state = buf[2:], "headers"
            elif state == "headers":
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > MAX_HEADERS:
                        raise FormError("form part headers too long")
                    break
                name, filename, is_file = _start_part(buf[:end], fields, filename)
                buf, state = buf[end + 4:], "body" if is_file else "field"
            else:
                at = buf.find(delimiter)
                # without a delimiter, keep its length less one: one may straddle two chunks
                keep = at if at >= 0 else max(0, len(buf) - len(delimiter) + 1)
                data, buf = buf[:keep], buf[keep:]
                if state == "body":
                    sink(data)
                else:
                    fields[name] += data
                    if len(fields[name]) > MAX_FIELD:
                        raise FormError(f"form field {name!r} is too long")
                if at < 0:
                    break
                buf, state = buf[len(delimiter):], "after_delimiter"
    raise FormError("the multipart body ended before its closing delimiter")
