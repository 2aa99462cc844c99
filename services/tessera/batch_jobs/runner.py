"""BatchRunner: each gateway runs one. It polls the store for active jobs, takes the lease of
up to `batch_jobs` of them and runs each: validate the input file, send the lines not yet
done (all jobs together at most `batch_concurrency` at a time), then write the output and
error files and set the final status. The lease is renewed while the job runs; a runner that
loses it stops at once, and one that dies lets the lease lapse, so another gateway (or the
same one restarted) picks the job up where the store says it stands.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Callable

import httpx

from tessera import logs
from tessera.batch_jobs.config import BatchConfig
from tessera.batch_jobs.executor import LineSender, run_lines
from tessera.batch_jobs.files import FileStore
from tessera.batch_jobs.format import BatchLine, FileError, expired_record, parse, succeeded
from tessera.batch_jobs.jobs import TERMINAL, LeaseLost

log = logging.getLogger("tessera.batch")
WATCH_S = 1.0        # how often a running job looks for a cancel or its expiry
RETRY_S = 30.0       # a job that failed here (a bug, a store outage) is not taken again sooner


class BatchRunner:
    def __init__(self, store, files: FileStore, client_for: Callable[[dict | None], httpx.AsyncClient],
                 config: BatchConfig, poll_s: float = 1.0) -> None:
        """client_for(key): an HTTP client whose requests count against `key` (the job's owner)."""
        self.store, self.files, self.client_for, self.config, self.poll_s = store, files, client_for, config, poll_s
        self.gate = asyncio.Semaphore(config.batch_concurrency)
        self.running: dict[str, asyncio.Task] = {}
        self.not_before: dict[str, float] = {}       # batch id -> when this runner may take it again
        self.wake = asyncio.Event()

    async def serve(self) -> None:
        """Poll for jobs until cancelled; then stop the jobs held here and give their leases back."""
        try:
            while True:
                await self.poll()
                try:
                    await asyncio.wait_for(self.wake.wait(), self.poll_s)
                except asyncio.TimeoutError:
                    pass
                self.wake.clear()
        finally:
            for task in list(self.running.values()):
                task.cancel()
            await asyncio.gather(*self.running.values(), return_exceptions=True)

    async def poll(self) -> None:
        try:
            for batch_id in await self.store.active():
                if len(self.running) >= self.config.batch_jobs:
                    return
                if batch_id in self.running or self.not_before.get(batch_id, 0.0) > time.monotonic():
                    continue
                token = uuid.uuid4().hex
                if await self.store.acquire(batch_id, token, self.config.batch_lease_s):
                    self.running[batch_id] = asyncio.create_task(self._hold(batch_id, token))
        except Exception as e:     # the store is unreachable: try again at the next poll
            log.warning("batch poll failed: %s", e)

    async def _hold(self, batch_id: str, token: str) -> None:
        """Run the job, renewing its lease; a lease that cannot be renewed stops the work."""
        ttl = self.config.batch_lease_s
        work = asyncio.create_task(self._run(batch_id, token))
        renewed = time.monotonic()
        try:
            while not work.done():
                await asyncio.wait({work}, timeout=ttl / 3)
                try:
                    if not work.done() and await self.store.renew(batch_id, token, ttl):
                        renewed = time.monotonic()
                except Exception as e:
                    log.warning("batch %s: lease renewal failed: %s", batch_id, e)
                if time.monotonic() - renewed > ttl:
                    work.cancel()
            if work.cancelled():
                logs.event(log, "batch lease not renewed: stopped", batch=batch_id)
            else:
                work.result()
        except LeaseLost:
            logs.event(log, "batch lease lost", batch=batch_id)
        except asyncio.CancelledError:
            work.cancel()
            raise
        except Exception:
            log.exception("batch %s failed in this runner (left for the next one)", batch_id)
            self.not_before[batch_id] = time.monotonic() + RETRY_S
        finally:
            self.running.pop(batch_id, None)
            try:
                await self.store.release(batch_id, token)
            except Exception:
                pass          # it lapses by itself

    async def _run(self, batch_id: str, token: str) -> None:
        job = await self.store.get(batch_id)
        if job is None or job["status"] in TERMINAL:
            return
        if job["status"] == "cancelling":
            return await self._conclude(job, [], token)
        lines = await self._input(job, token)
        if lines is None:
            return
        if job["status"] == "validating":
            await self.store.update(batch_id, ("validating",), {"status": "in_progress", "total": len(lines),
                                                                "in_progress_at": int(time.time())}, token)
            logs.event(log, "batch started", batch=batch_id, requests=len(lines))
        job = await self.store.get(batch_id)
        if job["status"] == "in_progress":
            await self._execute(job, lines, token)
        await self._conclude(await self.store.get(batch_id), lines, token)

    async def _input(self, job: dict, token: str) -> list[BatchLine] | None:
        """The parsed input file; None (and the job failed) when it is malformed or gone."""
        try:
            return parse(await asyncio.to_thread(self.files.read, job["input_file_id"]), job["endpoint"])
        except (OSError, FileError) as e:
            error = {"code": getattr(e, "code", "file_not_found"), "param": "input_file_id",
                     "message": getattr(e, "reason", f"the input file {job['input_file_id']} cannot be read"),
                     "line": getattr(e, "line", None)}
            await self.store.update(job["id"], ("validating", "in_progress"), {
                "status": "failed", "failed_at": int(time.time()), "errors": {"object": "list", "data": [error]}}, token)
            logs.event(log, "batch failed", batch=job["id"], error=str(e))
            return None

    async def _execute(self, job: dict, lines: list[BatchLine], token: str) -> None:
        """Send the lines not yet done until all are, the job is cancelled or it expires."""
        batch_id, done = job["id"], await self.store.done(job["id"])

        async def keep(line: BatchLine, record: dict) -> None:
            await self.store.record(batch_id, token, line.index, record, "completed" if succeeded(record) else "failed")
        async with self.client_for(job["key"]) as http:
            todo = [line for line in lines if line.index not in done]
            run = asyncio.create_task(run_lines(todo, LineSender(http, deadline=job["expires_at"]),
                                                self.config.batch_concurrency, keep, self.gate))
            try:
                while not run.done():
                    await asyncio.wait({run}, timeout=WATCH_S)
                    current = await self.store.get(batch_id)
                    if current["status"] != "in_progress" or time.time() >= job["expires_at"]:
                        run.cancel()
            finally:
                run.cancel()       # no-op once done; stops the lines if this runner is stopped
            outcome = (await asyncio.gather(run, return_exceptions=True))[0]
        if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
            raise outcome

    async def _conclude(self, job: dict, lines: list[BatchLine], token: str) -> None:
        """Write the output and error files and set the final status, if the job has one yet:
        cancelled, expired (a line could not run in the window) or completed."""
        batch_id, status = job["id"], job["status"]
        results = await self.store.finished(batch_id)
        if status in ("in_progress", "finalizing"):
            missing = [line for line in lines if line.index not in results]
            if missing and time.time() < job["expires_at"]:
                return          # interrupted: the next holder of the lease goes on
            for line in missing:
                await self.store.record(batch_id, token, line.index, expired_record(line), "failed")
            if missing:
                results = await self.store.finished(batch_id)
            if status == "in_progress" and not await self.store.update(
                    batch_id, ("in_progress",), {"status": "finalizing", "finalizing_at": int(time.time())}, token):
                return          # cancelled meanwhile: concluded as such on the next pick-up
        elif status != "cancelling":
            return
        expired = any((r.get("error") or {}).get("code") == "batch_expired" for r in results.values())
        final = "cancelled" if status == "cancelling" else "expired" if expired else "completed"
        outputs = await self._write_outputs(job, results)
        if await self.store.update(batch_id, ("finalizing", "cancelling"),
                                   {"status": final, f"{final}_at": int(time.time()), **outputs}, token):
            await self.store.drop_results(batch_id)
            logs.event(log, f"batch {final}", batch=batch_id, **outputs)

    async def _write_outputs(self, job: dict, results: dict[int, dict]) -> dict:
        """The output (2xx) and error files from the recorded results, in input order; the ids
        follow from the batch's, so a finalization done again rewrites the same files."""
        kinds = {"output": [], "error": []}
        for index in sorted(results):
            kinds["output" if succeeded(results[index]) else "error"].append(results[index])
        ids = {}
        for kind, records in kinds.items():
            ids[f"{kind}_file_id"] = None
            if records:
                file_id = f"file-{job['id'].removeprefix('batch_')}-{kind}"
                content = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
                await asyncio.to_thread(self.files.create, file_id, content, f"{job['id']}_{kind}.jsonl",
                                        "batch_output", job["owner"])
                ids[f"{kind}_file_id"] = file_id
        return ids
