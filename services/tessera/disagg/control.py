"""The AFD control plane as plain dataclasses: what an attention node sends an expert node to
link their transport endpoints, and what it gets back. The gRPC client (rpc/expert_client.py)
and the in-process twin (LocalExpertControl) share this interface."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ConnectRequest:
    attention_node: str
    transport: str
    transport_metadata: bytes
    model_id: str
    num_layers: int


@dataclass(frozen=True)
class ConnectReply:
    expert_node: str
    transport_metadata: bytes
    shard_index: int
    shard_count: int
    experts: tuple[int, ...] = ()     # the MoE experts this node holds (empty: dense model)


@dataclass(frozen=True)
class ExpertInfo:
    expert_node: str
    model_id: str
    shard_index: int
    shard_count: int
    transport: str
    tokens_in: int
    rejected: int
    attention_nodes: tuple[str, ...]
    compute_s: float = 0.0
    batches: int = 0
    uptime_s: float = 0.0
    experts: tuple[int, ...] = ()


class LinkRefused(RuntimeError):
    """The expert node cannot serve this attention node (other model, other transport)."""


class ExpertControl(Protocol):
    def connect(self, request: ConnectRequest) -> ConnectReply: ...

    def info(self) -> ExpertInfo: ...


class LocalExpertControl:
    """In-process twin of the gRPC control channel: calls the ExpertNode directly."""

    def __init__(self, node) -> None:
        self.node = node

    def connect(self, request: ConnectRequest) -> ConnectReply:
        return self.node.connect(request)

    def info(self) -> ExpertInfo:
        return self.node.info()
