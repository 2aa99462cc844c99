"""GrpcStageControl: stage 0's side of a later stage's PipelineShard control service (blocking
calls: they run at start-up and, on the engine thread, when the ring is relinked)."""
from __future__ import annotations

import grpc

from tessera import mtls
from tessera.pipeline.control import StageInfo, StageLink, StageReply
from tessera.rpc import convert, options
from tessera.rpc.v1 import pipeline_pb2, pipeline_pb2_grpc


class GrpcStageControl:
    def __init__(self, address: str, timeout_s: float = 10.0) -> None:
        self.address, self.timeout_s = address, timeout_s
        self._channel = mtls.channel(address, "pipeline-shard", options.RECONNECT)
        self._stub = pipeline_pb2_grpc.PipelineShardStub(self._channel)

    def connect(self, link: StageLink) -> StageReply:
        try:
            reply = self._stub.Connect(convert.stage_link_to_proto(link), timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise convert.stage_error_from_status(e.code(), f"{self.address}: {e.details()}") from None
        return convert.stage_reply_from_proto(reply)

    def info(self) -> StageInfo:
        try:
            reply = self._stub.StageInfo(pipeline_pb2.StageInfoRequest(), timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise convert.stage_error_from_status(e.code(), f"{self.address}: {e.details()}") from None
        return convert.stage_info_from_proto(reply)

    def close(self) -> None:
        self._channel.close()
