"""The gateway's Batch API as create_app(batch=...) takes it: the routes (batch_jobs/routes.py),
the upload's own body limit, and run(app), this gateway's job runner (batch_jobs/runner.py),
which sends each job's lines back into `app` as the job's owner, so they meet the same
admission (API key limits, in-flight bound), validation and serving as any chat request."""
from __future__ import annotations

import logging

from tessera.batch_jobs import jobs
from tessera.batch_jobs.config import BatchConfig
from tessera.batch_jobs.executor import in_process
from tessera.batch_jobs.files import FORM_OVERHEAD, FileStore
from tessera.batch_jobs.routes import router
from tessera.batch_jobs.runner import BatchRunner
from tessera.entrypoints.gateway.admission import KeyInfo
from tessera.entrypoints.gateway.app import BATCH_KEY_SCOPE


class BatchAPI:
    def __init__(self, config: BatchConfig, store) -> None:
        """store: a RedisJobStore, or its in-process twin MemoryJobStore."""
        self.config, self.store = config, store
        self.files = FileStore(config.directory(), config.max_file_bytes)
        self.body_limits = {"/v1/files": config.max_file_bytes + FORM_OVERHEAD}
        self.runner: BatchRunner | None = None
        self.router = router(self)

    @classmethod
    def build(cls, config: BatchConfig, registry_url: str | None, prefix: str) -> "BatchAPI":
        """Job state in --jobs-redis, else the registry's Redis, else this process's memory."""
        url = config.jobs_redis or registry_url
        if url:
            from tessera.batch_jobs.redis_jobs import RedisJobStore
            return cls(config, RedisJobStore(url, prefix))
        return cls(config, jobs.MemoryJobStore())

    async def run(self, app) -> None:
        """The runner, until the app stops (a background task of create_app)."""
        def client_for(key: dict | None):
            return in_process(app, {BATCH_KEY_SCOPE: KeyInfo(**key) if key else None})
        logging.getLogger("httpx").setLevel(logging.WARNING)    # one line per request: the access log has them
        self.runner = BatchRunner(self.store, self.files, client_for, self.config)
        try:
            await self.runner.serve()
        finally:
            await self.store.close()
