"""`tessera run-batch -i requests.jsonl -o results.jsonl`: an OpenAI batch file, offline, as
`vllm run-batch` does. In this process by default: an engine built from the same EngineConfig
flags as `tessera serve`, behind the gateway's own app, called without a network (so each line
meets the gateway's validation and serving code); or against a running deployment with --url.
A malformed file is refused (exit 1) before any engine loads; malformed lines get error records.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import pathlib
import sys
import time

from tessera.batch_jobs.format import BatchLine, FileError, parse, succeeded
from tessera.config import EngineConfig
from tessera.entrypoints.flags import add_flags, from_args

PATIENCE_S = 600.0      # how long one line waits out 429/503 answers before keeping the last


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-i", "--input-file", required=True, help="requests, one JSON object a line (OpenAI batch format)")
    p.add_argument("-o", "--output-file", required=True, help="results, one a line, in input order")
    p.add_argument("--url", default=None,
                   help="OpenAI base URL of a running deployment (http://host:port/v1); default: run in this process")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="with --url: the key to send (default $OPENAI_API_KEY)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="lines in flight (default: --max-num-seqs in process, 16 with --url)")
    p.add_argument("--served-model-name", default=None, help="in process: the model id lines name (default: the engine's)")
    add_flags(p, EngineConfig)


def main(a: argparse.Namespace) -> int:
    try:
        lines = parse(pathlib.Path(a.input_file).read_bytes())
    except (OSError, FileError) as e:
        print(f"tessera run-batch: {a.input_file}: {e}", file=sys.stderr)
        return 1
    if a.concurrency is not None and a.concurrency < 1:
        print("tessera run-batch: --concurrency must be >= 1", file=sys.stderr)
        return 2
    logging.getLogger("httpx").setLevel(logging.WARNING)    # a line per request; the gateway's access log has them
    records, elapsed = _in_process(lines, a) if a.url is None else asyncio.run(_run(lines, None, a, a.concurrency or 16))
    out = pathlib.Path(a.output_file)
    tmp = out.with_name(out.name + ".part")
    with open(tmp, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(json.dumps(records[line.index], ensure_ascii=False) + "\n")
    os.replace(tmp, out)    # a reader never sees half a results file
    ok = sum(succeeded(r) for r in records.values())
    print(f"tessera run-batch: {len(lines)} requests: {ok} succeeded, {len(lines) - ok} failed in {elapsed:.3f} s "
          f"-> {out}", file=sys.stderr)
    return 0


def _in_process(lines: list[BatchLine], a: argparse.Namespace) -> tuple[dict[int, dict], float]:
    from tessera.async_engine import AsyncEngine
    from tessera.engine import Engine
    from tessera.entrypoints.gateway.admission import Admission, AdmissionConfig
    from tessera.entrypoints.gateway.app import create_app
    from tessera.local_client import LocalWorkerClient
    config = from_args(EngineConfig, a)
    engine = AsyncEngine(Engine(config))
    try:
        app = create_app(LocalWorkerClient(engine), a.served_model_name or engine.engine.model_id,
                         admission=Admission(AdmissionConfig()))
        return asyncio.run(_run(lines, app, a, a.concurrency or config.scheduler.max_num_seqs))
    finally:
        engine.shutdown()


async def _run(lines: list[BatchLine], app, a: argparse.Namespace, concurrency: int) -> tuple[dict[int, dict], float]:
    """Every line's record by its index: through `app` in this process, else to a.url; and the
    seconds from the first request sent to the last answer (no start-up, no file writing)."""
    from tessera.batch_jobs.executor import LineSender, in_process, remote, run_lines
    records: dict[int, dict] = {}

    async def keep(line: BatchLine, record: dict) -> None:
        records[line.index] = record
    async with (in_process(app) if app is not None else remote(a.url, a.api_key)) as http:
        start = time.perf_counter()
        await run_lines(lines, LineSender(http, patience_s=PATIENCE_S), concurrency, keep)
        return records, time.perf_counter() - start
