"""The draft worker process (SwiftSpec, docs/design/speculative.md#roles): load the draft model (a
self:K draft loads the target and runs its first K layers), keep every request's draft tree growing
on a background thread (spec.proposer.AsyncProposer) while the target verifies, and serve
tessera.rpc.v1.DraftWorker (rpc/draft_server.py) and grpc.health.v1. A target worker reaches it
with `--draft-address`; it registers with role "draft", which the gateway never routes to."""
from __future__ import annotations

import asyncio
import logging
import os
import sys


from typing import TYPE_CHECKING

from tessera.config import ConfigError, SpeculativeConfig
from tessera.entrypoints.aio_serve import serve_until_signal
from tessera.draft_api import DraftInfo

if TYPE_CHECKING:    # torch and the model load only in the draft worker, not where flags are built
    from tessera.rpc.draft_server import DraftRounds

log = logging.getLogger("tessera.draft_worker")
SERVICE = "tessera.rpc.v1.DraftWorker"
# SpeculativeConfig fields that are the target's business (it asks for each round's size).
TARGET_ONLY_FIELDS = ("draft_address", "disable_batch_size")


def load(spec: SpeculativeConfig, model: str, dtype: str, max_model_len: int | None = None):
    """(DraftRounds over an AsyncProposer, the proposer): the draft for target `model`."""
    from tessera.engine import resolve_dtype
    from tessera.models.loader import load_model, model_id_for
    from tessera.rpc.draft_server import DraftRounds
    from tessera.spec.draft_models import draft_model
    from tessera.spec.proposer import AsyncProposer
    if spec.draft is None or spec.draft == "ngram":
        raise ConfigError("a draft worker needs --speculative self:K, self@int4, self@int8 or a draft model", "speculative")
    torch_dtype = resolve_dtype(dtype)
    name = spec.draft.partition("@")[0]
    target = load_model(model, torch_dtype)[0] if name == "self" or name.startswith("self:") else None
    draft, layers = draft_model(spec.draft, target, torch_dtype)
    limit = draft.config.max_position_embeddings
    max_len = min(max_model_len or limit, limit)
    proposer = AsyncProposer(draft, layers, spec, max_len)
    info = DraftInfo(model_id_for(model), len(layers), draft.config.vocab_size, max_len)
    return DraftRounds(proposer, info, stats=proposer.stats), proposer


def pin(cpu: int | None) -> None:
    """Keep the draft on its own core (Linux), off the target's."""
    if cpu is None:
        return
    if not hasattr(os, "sched_setaffinity"):
        log.warning("--cpu %d ignored: this platform cannot pin processes", cpu)
        return
    os.sched_setaffinity(0, {cpu})


async def serve(rounds: DraftRounds, host: str, port: int, registration=None, metrics_port: int | None = None,
                shutdown_grace_s: float = 30.0) -> None:
    """Serve until SIGTERM / SIGINT; then leave the registry, say NOT_SERVING and give rounds
    in flight shutdown_grace_s."""
    from tessera.rpc.draft_server import DraftServicer
    from tessera.rpc.v1 import draft_pb2_grpc
    if metrics_port:
        from tessera.metrics import serve_draft_metrics
        serve_draft_metrics(rounds, metrics_port, host)

    def ready(bound: int) -> None:
        info = rounds.info()
        log.info("draft worker for %s (%d layers) on %s:%d", info.model_id, info.layers, host, bound)
        print(f"tessera draft worker ready on {host}:{bound}", flush=True)
    await serve_until_signal(
        lambda server: draft_pb2_grpc.add_DraftWorkerServicer_to_server(DraftServicer(rounds), server),
        SERVICE, host, port, [_register(rounds, registration)] if registration else [], ready, shutdown_grace_s)


async def _register(rounds: DraftRounds, registration) -> None:
    """Heartbeat a role "draft" record (load: requests with draft state) until cancelled."""
    import uuid

    from tessera.registry import RedisRegistry, WorkerRecord, stay_registered
    url, prefix, address = registration
    registry = RedisRegistry(url, prefix=prefix)
    worker_id = f"draft-{address}-{uuid.uuid4().hex[:6]}"

    def record() -> WorkerRecord:
        info = rounds.info()
        return WorkerRecord(worker_id, "draft", info.model_id, address, rounds.max_requests, info.requests)
    await stay_registered(registry, worker_id, record)


def main(spec: SpeculativeConfig, model: str, dtype: str, max_model_len: int | None, host: str, port: int,
         threads: int | None = 1, cpu: int | None = None, registration=None, metrics_port: int | None = None,
         shutdown_grace_s: float = 30.0) -> int:
    """`tessera draft-worker`."""
    pin(cpu)
    if threads:
        import torch
        torch.set_num_threads(threads)
    rounds, proposer = load(spec, model, dtype, max_model_len)
    # The expansion thread runs Python between torch calls; a short GIL switch interval
    # lets a round (gRPC thread) in within ~1 ms instead of the default 5 ms slices.
    sys.setswitchinterval(0.0005)
    try:
        asyncio.run(serve(rounds, host, port, registration, metrics_port, shutdown_grace_s))
    finally:
        proposer.close()
    return 0
