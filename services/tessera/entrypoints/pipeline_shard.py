"""The pipeline stage process (`tessera pipeline-shard`, LLM-PQ:
docs/design/pipeline.md#micro-batches). Stage 0 is a worker: it serves tessera.rpc.v1.Worker to the
gateway with a PipelineRunner, links the later stages (--shard) at start-up
(pipeline/first_stage.py) and registers as a worker. A later stage loads only its layers
(pipeline/shard.py), serves tessera.rpc.v1.PipelineShard (control only) and grpc.health.v1,
registers with role "pipeline_shard" (which the gateway never routes to) and, with --metrics-port,
serves the tessera_pipeline_shard_* metrics."""
from __future__ import annotations

import asyncio
import logging
import sys

import grpc

from tessera import exit_codes
from tessera.config import ConfigError, EngineConfig
from tessera.entrypoints.aio_serve import serve_until_signal
from tessera.pipeline.control import StageRefused
from tessera.pipeline.stages import StageConfig
from tessera.rpc import convert
from tessera.rpc.v1 import pipeline_pb2_grpc
from tessera.transport.base import TransportError
from tessera.worker_api import Unavailable

log = logging.getLogger("tessera.pipeline_shard")
SERVICE = "tessera.rpc.v1.PipelineShard"


class PipelineShardServicer(pipeline_pb2_grpc.PipelineShardServicer):
    def __init__(self, shard) -> None:
        self.shard = shard

    async def Connect(self, request, context):
        try:
            reply = await asyncio.to_thread(self.shard.connect, convert.stage_link_from_proto(request))
            return convert.stage_reply_to_proto(reply)
        except StageRefused as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except (TransportError, ValueError, KeyError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot link: {e}")

    async def StageInfo(self, request, context):
        return convert.stage_info_to_proto(self.shard.info())


async def serve_shard(shard, host: str, port: int, registration=None, metrics_port: int | None = None,
                      shutdown_grace_s: float = 30.0) -> None:
    """Serve until SIGTERM / SIGINT; then leave the registry, say NOT_SERVING and give calls in
    flight shutdown_grace_s."""
    if metrics_port:
        from tessera.pipeline.metrics import serve_shard_metrics
        serve_shard_metrics(shard, metrics_port, host)

    def ready(bound: int) -> None:
        log.info("pipeline stage %d (layers %d:%d) on %s:%d", shard.stage, shard.layers.start, shard.layers.stop,
                 host, bound)
        print(f"tessera pipeline shard {shard.name} ready on {host}:{bound}", flush=True)
    await serve_until_signal(
        lambda server: pipeline_pb2_grpc.add_PipelineShardServicer_to_server(PipelineShardServicer(shard), server),
        SERVICE, host, port, [_register(shard, registration)] if registration else [], ready, shutdown_grace_s)


async def _register(shard, registration) -> None:
    """Heartbeat a role "pipeline_shard" record until cancelled: discoverable, never routed to."""
    import uuid

    from tessera.registry import RedisRegistry, WorkerRecord, stay_registered
    url, prefix, address = registration
    registry = RedisRegistry(url, prefix=prefix)
    worker_id = f"pipeline-shard-{address}-{uuid.uuid4().hex[:6]}"
    await stay_registered(registry, worker_id,
                          lambda: WorkerRecord(worker_id, "pipeline_shard", shard.model_id, address, 1, 0))


def main(config: EngineConfig, stage: StageConfig, host: str, port: int, registration=None,
         metrics_port: int | None = None, shutdown_grace_s: float = 30.0) -> int:
    """`tessera pipeline-shard`: exit 2 with a message when the stage cannot run (a memory
    budget it exceeds, layers or a precision that do not fit, a later stage that never came)."""
    try:
        if stage.stage == 0:
            from tessera.entrypoints.worker import serve
            from tessera.pipeline.first_stage import build_first_stage
            from tessera.rpc.pipeline_client import GrpcStageControl
            controls = [GrpcStageControl(address) for address in stage.shards]
            asyncio.run(serve(config, host, port, build=lambda: build_first_stage(config, stage, controls),
                              role="worker", registration=registration, metrics_port=metrics_port,
                              shutdown_grace_s=shutdown_grace_s))
            return 0
        from tessera.pipeline.shard import load_shard
        if config.num_threads:
            import torch
            torch.set_num_threads(config.num_threads)
        shard = load_shard(config, stage)
        try:
            asyncio.run(serve_shard(shard, host, port, registration, metrics_port, shutdown_grace_s))
        finally:
            shard.close()
        return 0
    except (ConfigError, StageRefused) as e:   # the same on every restart
        return exit_codes.config_error("pipeline-shard", f"stage {stage.stage}: {e}")
    except (TransportError, Unavailable, ValueError) as e:   # a peer not there yet: a restart may find it
        print(f"tessera pipeline-shard: stage {stage.stage}: {e}", file=sys.stderr)
        return 2
