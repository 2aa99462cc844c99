"""HTTP routes of OpenAI's Files and Batch APIs (/v1/files, /v1/batches): shapes and checks
only. `api` (entrypoints/gateway/batch_api.py) holds the file store (files.py), the job store
(jobs.py, redis_jobs.py) and the runner (runner.py). The routes sit behind the gateway's
middleware (the API-key rules of every /v1 route; uploads have their own size limit); a key
sees only its own files and batches (404 for another's).
"""
from __future__ import annotations

import dataclasses
import logging
import time

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel, StrictStr

from tessera.batch_jobs import files as file_objects
from tessera.batch_jobs import jobs
from tessera.batch_jobs.files import TooLarge, UploadError
from tessera.batch_jobs.format import ENDPOINTS
from tessera.openai_api.errors import APIError

log = logging.getLogger("tessera.batch")


class BatchCreate(BaseModel):
    input_file_id: StrictStr
    endpoint: StrictStr
    completion_window: StrictStr
    metadata: dict[StrictStr, StrictStr] | None = None


async def _stored(call):
    """Await a job-store call; an unreachable store is 503, not a 500."""
    try:
        return await call
    except Exception as e:
        log.warning("batch job store: %s", e)
        raise APIError(503, "Batch job state is unavailable right now; retry later.", None,
                       "service_unavailable", 2) from None


def _owner(request: Request) -> tuple[str, dict | None]:
    key = getattr(request.state, "api_key", None)
    return (key.counter_id, dataclasses.asdict(key)) if key is not None else ("", None)   # names are not unique


def _page(data: list[dict], has_more: bool) -> dict:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def router(api) -> APIRouter:
    """api: a BatchAPI (files, store, config, runner)."""
    r = APIRouter()
    _file_routes(r, api)
    _batch_routes(r, api)
    return r


def _file_routes(r: APIRouter, api) -> None:
    def file_or_404(file_id: str, request: Request) -> dict:
        record = api.files.get(file_id, _owner(request)[0])
        if record is None:
            raise APIError(404, f"No such File object: {file_id}", "file_id", "file_not_found")
        return record

    @r.post("/v1/files")
    async def upload(request: Request):
        try:
            record, _ = await api.files.upload(request.stream(), request.headers.get("content-type", ""),
                                               _owner(request)[0])
        except TooLarge:
            raise request.app.state.admission.reject(
                413, f"File larger than {api.config.max_file_bytes} bytes.", "request_too_large") from None
        except UploadError as e:
            raise APIError(400, str(e), e.param) from None
        return file_objects.public(record)

    @r.get("/v1/files")
    async def list_files(request: Request, purpose: str | None = None, after: str | None = None,
                         limit: int = Query(10000, ge=1, le=10000), order: str = Query("desc", pattern="^(asc|desc)$")):
        records = api.files.list(_owner(request)[0], purpose)[::1 if order == "desc" else -1]
        ids = [f["id"] for f in records]
        start = ids.index(after) + 1 if after in ids else 0
        return _page([file_objects.public(f) for f in records[start:start + limit]], start + limit < len(records))

    @r.get("/v1/files/{file_id}")
    async def get_file(file_id: str, request: Request):
        return file_objects.public(file_or_404(file_id, request))

    @r.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str, request: Request):
        file_or_404(file_id, request)
        return FileResponse(api.files.data_path(file_id), media_type="application/octet-stream")

    @r.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, request: Request):
        if not api.files.delete(file_id, _owner(request)[0]):
            raise APIError(404, f"No such File object: {file_id}", "file_id", "file_not_found")
        return {"id": file_id, "object": "file", "deleted": True}


def _batch_routes(r: APIRouter, api) -> None:
    async def batch_or_404(batch_id: str, request: Request) -> dict:
        record = await _stored(api.store.get(batch_id))
        if record is None or record["owner"] != _owner(request)[0]:
            raise APIError(404, f"No such Batch object: {batch_id}", "batch_id", "batch_not_found")
        return record

    @r.post("/v1/batches")
    async def create_batch(body: BatchCreate, request: Request):
        if body.endpoint not in ENDPOINTS:
            raise APIError(400, f"endpoint must be one of: {', '.join(ENDPOINTS)}", "endpoint")
        if body.completion_window not in jobs.WINDOWS:
            raise APIError(400, f"completion_window must be one of: {', '.join(jobs.WINDOWS)}", "completion_window")
        owner, key = _owner(request)
        source = api.files.get(body.input_file_id, owner)
        if source is None or source["purpose"] != "batch":
            raise APIError(400, f"input_file_id {body.input_file_id} is not a file uploaded with purpose "
                           "'batch'", "input_file_id", "invalid_file")
        record = jobs.new_batch(body.input_file_id, body.endpoint, body.completion_window, body.metadata, owner, key)
        await _stored(api.store.create(record))
        if api.runner is not None:
            api.runner.wake.set()
        return jobs.public(record)

    @r.get("/v1/batches")
    async def list_batches(request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=100)):
        records, more = await _stored(api.store.list(_owner(request)[0], after, limit))
        return _page([jobs.public(b) for b in records], more)

    @r.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str, request: Request):
        return jobs.public(await batch_or_404(batch_id, request))

    @r.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, request: Request):
        await batch_or_404(batch_id, request)
        fields = {"status": "cancelling", "cancelling_at": int(time.time())}
        if await _stored(api.store.update(batch_id, jobs.CANCELLABLE, fields)):
            return jobs.public(await batch_or_404(batch_id, request))
        record = await batch_or_404(batch_id, request)
        if record["status"] in ("cancelling", "cancelled"):
            return jobs.public(record)
        raise APIError(409, f"Cannot cancel a batch with status {record['status']}.", "batch_id", "batch_not_cancellable")
