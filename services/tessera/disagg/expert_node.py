"""An expert node: one shard of every layer's FFN, a transport endpoint, and the worker
threads that answer attention nodes. Plain Python; entrypoints/expert_node.py puts gRPC on it."""
from __future__ import annotations

import time

from tessera.disagg.control import ConnectReply, ConnectRequest, ExpertInfo, LinkRefused
from tessera.disagg.expert_shard import ExpertShard, ExpertWorker
from tessera.transport.base import Transport


class ExpertNode:
    def __init__(self, name: str, shard: ExpertShard, transport: Transport, transport_name: str,
                 model_id: str, shard_index: int, shard_count: int, timeout_s: float = 60.0) -> None:
        self.name, self.shard, self.transport = name, shard, transport
        self.transport_name, self.model_id = transport_name, model_id
        self.shard_index, self.shard_count = shard_index, shard_count
        self.worker = ExpertWorker(shard, transport, timeout_s=timeout_s)
        self.attention_nodes: list[str] = []
        self.started = time.monotonic()

    def connect(self, request: ConnectRequest) -> ConnectReply:
        if request.transport != self.transport_name:
            raise LinkRefused(f"expert node {self.name} uses transport {self.transport_name}, "
                              f"not {request.transport}")
        if request.model_id != self.model_id or request.num_layers != len(self.shard.layers):
            raise LinkRefused(f"expert node {self.name} serves {self.model_id} "
                              f"({len(self.shard.layers)} layers), not {request.model_id}")
        self.transport.connect(request.attention_node, request.transport_metadata)
        metadata = self.transport.metadata_for(request.attention_node)
        self.worker.add_source(request.attention_node)
        if request.attention_node not in self.attention_nodes:
            self.attention_nodes.append(request.attention_node)
        return ConnectReply(self.name, metadata, self.shard_index, self.shard_count, self.shard.experts)

    def info(self) -> ExpertInfo:
        w = self.worker
        return ExpertInfo(self.name, self.model_id, self.shard_index, self.shard_count, self.transport_name,
                          w.tokens_in, w.rejected, tuple(self.attention_nodes), w.compute_s, w.batches,
                          time.monotonic() - self.started, self.shard.experts)

    def close(self) -> None:
        self.worker.stop()
        self.transport.close()
