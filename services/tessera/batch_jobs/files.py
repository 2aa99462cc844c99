"""The /v1/files store: a directory holding each file's bytes ({id}.data) beside its OpenAI
File object ({id}.json, written last, atomically: a file exists once its record does).
Gateways that share jobs share the directory (a volume). Ids are checked before they name a
path, and each record keeps its owner (the API key's name) so one key never sees another's.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import tempfile
import time
import uuid
from typing import AsyncIterator

from tessera.batch_jobs.multipart import FormError, read_form

FILE_ID = re.compile(r"file-[A-Za-z0-9_-]{1,80}")
PURPOSES = ("batch",)      # what clients may upload; outputs are "batch_output"
FORM_OVERHEAD = 64 << 10   # multipart framing and text fields allowed beyond the file's own bytes


class TooLarge(Exception):
    pass


class UploadError(ValueError):
    """A malformed upload (400); `param` names the form field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class FileStore:
    def __init__(self, directory: str, max_bytes: int) -> None:
        self.dir, self.max_bytes = pathlib.Path(directory), max_bytes   # made on the first write

    def _path(self, file_id: str, suffix: str) -> pathlib.Path:
        return self.dir / f"{file_id}{suffix}"

    async def upload(self, chunks: AsyncIterator[bytes], content_type: str, owner: str) -> tuple[dict, dict]:
        """Stream a multipart upload to disk: (File object, form fields). Raises TooLarge past
        max_bytes, UploadError for a malformed form or a purpose other than PURPOSES."""
        file_id = f"file-{uuid.uuid4().hex}"
        self.dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".upload")
        size = 0
        try:
            with os.fdopen(fd, "wb") as out:
                def sink(data: bytes) -> None:
                    nonlocal size
                    size += len(data)
                    if size > self.max_bytes:
                        raise TooLarge(f"File larger than {self.max_bytes} bytes.")
                    out.write(data)
                try:
                    fields, filename = await read_form(_limited(chunks, self.max_bytes + FORM_OVERHEAD),
                                                       content_type, sink)
                except FormError as e:
                    raise UploadError(str(e), "file") from None
            if filename is None:
                raise UploadError("the form has no `file` part", "file")
            if fields.get("purpose") not in PURPOSES:
                raise UploadError(f"purpose must be one of: {', '.join(PURPOSES)}", "purpose")
            os.replace(tmp, self._path(file_id, ".data"))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return self._write_record(file_id, filename, fields["purpose"], size, owner), fields

    def create(self, file_id: str, content: bytes, filename: str, purpose: str, owner: str) -> dict:
        """Write a file the server makes (batch outputs); writing the same id again replaces it."""
        self.dir.mkdir(parents=True, exist_ok=True)
        data = self._path(file_id, ".data")
        tmp = data.with_suffix(".tmp")
        tmp.write_bytes(content)
        os.replace(tmp, data)
        return self._write_record(file_id, filename, purpose, len(content), owner)

    def _write_record(self, file_id: str, filename: str, purpose: str, size: int, owner: str) -> dict:
        record = {"id": file_id, "object": "file", "bytes": size, "created_at": int(time.time()),
                  "filename": os.path.basename(filename)[:256] or "upload", "purpose": purpose,
                  "status": "processed", "expires_at": None, "status_details": None, "owner": owner}
        meta = self._path(file_id, ".json")
        tmp = meta.with_suffix(".jtmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, meta)
        return record

    def get(self, file_id: str, owner: str) -> dict | None:
        if not FILE_ID.fullmatch(file_id):
            return None
        try:
            record = json.loads(self._path(file_id, ".json").read_text())
        except (OSError, ValueError):
            return None
        return record if record.get("owner") == owner else None

    def read(self, file_id: str) -> bytes:
        return self._path(file_id, ".data").read_bytes()

    def data_path(self, file_id: str) -> pathlib.Path:
        return self._path(file_id, ".data")

    def list(self, owner: str, purpose: str | None = None) -> list[dict]:
        """The owner's files, newest first."""
        records = (self.get(p.stem, owner) for p in self.dir.glob("file-*.json"))
        found = [r for r in records if r is not None and (purpose is None or r["purpose"] == purpose)]
        return sorted(found, key=lambda r: (r["created_at"], r["id"]), reverse=True)

    def delete(self, file_id: str, owner: str) -> bool:
        if self.get(file_id, owner) is None:
            return False
        self._path(file_id, ".json").unlink(missing_ok=True)    # the record first: gone at once
        self._path(file_id, ".data").unlink(missing_ok=True)
        return True


def public(record: dict) -> dict:
    """The File object as OpenAI shows it (without the owner)."""
    return {k: v for k, v in record.items() if k != "owner"}


async def _limited(chunks: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes]:
    """The body, refused past `limit` bytes (form overhead included) even before parsing."""
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"Upload larger than {limit} bytes.")
        yield chunk
