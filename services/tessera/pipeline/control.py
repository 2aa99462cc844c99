"""The pipeline's control plane as plain dataclasses: how stage 0 links the later stages into a
ring (stage 0 -> 1 -> ... -> N-1 -> stage 0) and what a stage reports about itself. The gRPC
client (rpc/pipeline_client.py) and the in-process twin (LocalStageControl) share StageControl.

Linking is two rounds of Connect, because a stage's transport metadata may be particular to
each peer (NIXL registers a receive region per peer): round 1 carries no peer metadata and
gets each stage's metadata for its two neighbours; round 2 hands every stage its neighbours'
metadata, and the stage starts serving. A Connect always drops the stage's previous link.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class StageLink:
    """What stage 0 tells stage `stage_index`: the pipeline it joins and its neighbours."""
    pipeline: str                  # stage 0's endpoint name
    transport: str
    model_id: str
    num_layers: int
    stage_index: int
    stage_count: int
    layers: tuple[int, int]        # [start, end) stage 0 expects this stage to hold
    bits: tuple[int, ...]          # the precision stage 0 expects for each of those layers
    dtype: str
    num_blocks: int
    block_size: int
    upstream: str                  # endpoint it receives hidden states from
    downstream: str                # endpoint it sends its output to
    peer_metadata: dict[str, bytes] = field(default_factory=dict)   # round 2: neighbour -> its metadata


@dataclass(frozen=True)
class StageReply:
    stage: str                     # the stage's endpoint name
    metadata: dict[str, bytes]     # its transport metadata for each neighbour


@dataclass(frozen=True)
class StageInfo:
    stage: str
    model_id: str
    stage_index: int
    layers: tuple[int, int]
    bits: tuple[int, ...]
    dtype: str
    transport: str
    num_blocks: int
    block_size: int
    weight_bytes: int
    kv_bytes: int
    memory_budget_bytes: int       # 0: no budget
    pipeline: str = ""             # the stage 0 it serves ("" until linked)
    micro_batches: int = 0         # micro-batches computed since start
    tokens: int = 0
    rejected: int = 0
    compute_s: float = 0.0
    uptime_s: float = 0.0


class StageRefused(RuntimeError):
    """The stage cannot join this pipeline (other model, layers, precision, cache or transport)."""


class StageControl(Protocol):
    def connect(self, link: StageLink) -> StageReply: ...

    def info(self) -> StageInfo: ...


class LocalStageControl:
    """In-process twin of the gRPC control channel: calls the PipelineShard directly."""

    def __init__(self, shard) -> None:
        self.shard = shard

    def connect(self, link: StageLink) -> StageReply:
        return self.shard.connect(link)

    def info(self) -> StageInfo:
        return self.shard.info()
