"""The expert node process: load this node's FFN shard, open its transport endpoint, serve
tessera.rpc.v1.ExpertNode (control only) and grpc.health.v1."""
from __future__ import annotations

import logging
import signal
import sys
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tessera import exit_codes, mtls
from tessera.disagg.control import LinkRefused
from tessera.disagg.expert_node import ExpertNode
from tessera.disagg.expert_shard import ExpertShard, expert_set, keep_ffn_share
from tessera.engine import resolve_dtype
from tessera.gc_heap import freeze_startup_heap
from tessera.models.loader import load_model, model_id_for
from tessera.rpc import convert
from tessera.rpc.v1 import expert_pb2_grpc
from tessera.transport import make_transport, resolve_backend
from tessera.transport.base import TransportError

log = logging.getLogger("tessera.expert_node")
SERVICE = "tessera.rpc.v1.ExpertNode"
EXPERT_SLOT_BYTES = 32 << 20   # e.g. 14k tokens of SmolLM2 (H = 576) per micro-batch


class ExpertNodeServicer(expert_pb2_grpc.ExpertNodeServicer):
    def __init__(self, node: ExpertNode) -> None:
        self.node = node

    def Connect(self, request, context):
        try:
            return convert.connect_reply_to_proto(self.node.connect(convert.connect_request_from_proto(request)))
        except LinkRefused as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except (TransportError, ValueError, KeyError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot link: {e}")

    def ExpertInfo(self, request, context):
        return convert.expert_info_to_proto(self.node.info())


def load_expert_node(model: str, dtype: str, name: str, index: int, count: int, transport: str,
                     timeout_s: float = 60.0, advertise: str | None = None,
                     experts: tuple[int, ...] | None = None) -> ExpertNode:
    """Only this node's share of the FFN weights stays in memory."""
    def prune(m):
        keep_ffn_share(m, expert_set(m.config, index, count, experts))
    pruned, _ = load_model(model, resolve_dtype(dtype), prune=prune)
    shard = ExpertShard.from_model(pruned, index, count, experts)
    del pruned
    backend = resolve_backend(transport)
    # Receive slots hold one dispatch: up to a scheduler chunk of tokens x (H + 2k) float32.
    transport = make_transport(backend, name, slots=4, capacity_bytes=EXPERT_SLOT_BYTES,
                               advertise=advertise)
    return ExpertNode(name, shard, transport, backend, model_id_for(model),
                      index, count, timeout_s)


def serve(node: ExpertNode, host: str, port: int, shutdown_grace_s: float = 30.0) -> None:
    """Serve until SIGTERM / SIGINT; then refuse new calls and give the ones in flight
    shutdown_grace_s to finish."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=mtls.SERVER_OPTIONS,
                         interceptors=[mtls.ServerInterceptor()])
    expert_pb2_grpc.add_ExpertNodeServicer_to_server(ExpertNodeServicer(node), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    bound = mtls.add_port(server, host, port)

    def drain(*_) -> None:
        health_servicer.enter_graceful_shutdown()
        server.stop(shutdown_grace_s)     # returns at once; wait_for_termination() then ends
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, drain)
    server.start()
    log.info("expert node %s (shard %d/%d) on %s:%d", node.name, node.shard_index, node.shard_count, host, bound)
    freeze_startup_heap()
    print(f"tessera expert node {node.name} ready on {host}:{bound}", flush=True)
    try:
        server.wait_for_termination()
    finally:
        node.close()


def main(model: str, dtype: str, name: str, shard_index: int, shard_count: int, transport: str,
         host: str, port: int, advertise: str | None = None, experts: tuple[int, ...] | None = None,
         threads: int | None = None, shutdown_grace_s: float = 30.0) -> int:
    """`tessera expert-node`: exit 2 with a message for an expert set this model does not have."""
    if threads:
        import torch
        torch.set_num_threads(threads)
    try:
        node = load_expert_node(model, dtype, name, shard_index, shard_count, transport,
                                advertise=advertise, experts=experts)
    except ValueError as e:   # a bad expert set or model: the same on every restart
        return exit_codes.config_error("expert-node", str(e))
    serve(node, host, port, shutdown_grace_s)
    return 0
