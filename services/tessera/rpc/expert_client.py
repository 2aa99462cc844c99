"""GrpcExpertControl: an attention node's side of the ExpertNode control service (blocking
calls: they run on the engine thread, at start-up and when a link is resynchronised)."""
from __future__ import annotations

import grpc

from tessera import mtls
from tessera.disagg.control import ConnectReply, ConnectRequest, ExpertInfo
from tessera.rpc import convert, options
from tessera.rpc.v1 import expert_pb2, expert_pb2_grpc


class GrpcExpertControl:
    def __init__(self, address: str, timeout_s: float = 10.0) -> None:
        self.address, self.timeout_s = address, timeout_s
        self._channel = mtls.channel(address, "expert-node", options.RECONNECT)
        self._stub = expert_pb2_grpc.ExpertNodeStub(self._channel)

    def connect(self, request: ConnectRequest) -> ConnectReply:
        try:
            reply = self._stub.Connect(convert.connect_request_to_proto(request), timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise convert.link_error_from_status(e.code(), f"{self.address}: {e.details()}") from None
        return convert.connect_reply_from_proto(reply)

    def info(self) -> ExpertInfo:
        try:
            reply = self._stub.ExpertInfo(expert_pb2.ExpertInfoRequest(), timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise convert.link_error_from_status(e.code(), f"{self.address}: {e.details()}") from None
        return convert.expert_info_from_proto(reply)

    def close(self) -> None:
        self._channel.close()
