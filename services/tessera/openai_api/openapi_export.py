"""The gateway's OpenAPI schema without a running deployment: `python -m
tessera.openai_api.openapi_export [--out FILE]` builds the gateway's FastAPI app (create_app,
with the Batch API, as `tessera gateway` builds it) in front of a worker client that is never
called, so no engine starts and no weights load, and prints the schema the gateway serves at
GET /openapi.json. The docs build renders it (docs/hooks/openapi_reference.py)."""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

MODEL_NAME = "MODEL"   # the served model id; the schema does not depend on it


class _NoWorker:
    """A WorkerClient for building the app only: any call means a route ran, which an export never does."""

    async def generate(self, request):
        raise RuntimeError("openapi_export: no worker behind this app")
        yield  # pragma: no cover  (makes this an async generator, as the interface has it)

    async def abort(self, request_id: str) -> None:
        raise RuntimeError("openapi_export: no worker behind this app")

    async def info(self, timeout_s: float = 5.0):
        raise RuntimeError("openapi_export: no worker behind this app")

    async def close(self) -> None:
        return None


def build_app():
    """The gateway's app with default admission and an in-memory Batch API job store."""
    from tessera.batch_jobs.config import BatchConfig
    from tessera.batch_jobs.jobs import MemoryJobStore
    from tessera.entrypoints.gateway.app import create_app
    from tessera.entrypoints.gateway.batch_api import BatchAPI
    return create_app(_NoWorker(), MODEL_NAME, batch=BatchAPI(BatchConfig(), MemoryJobStore()))


def openapi_schema() -> dict:
    return build_app().openapi()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tessera.openai_api.openapi_export", description=__doc__)
    parser.add_argument("--out", default=None, help="file to write (default: stdout)")
    args = parser.parse_args(argv)
    text = json.dumps(openapi_schema(), indent=2, sort_keys=True) + "\n"
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
