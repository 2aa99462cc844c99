"""GrpcWorkerClient: the gateway's side of the Worker service (WorkerClient interface)."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

import grpc

from tessera import cluster_auth, logs
from tessera.rpc import convert
from tessera.rpc.v1 import worker_pb2, worker_pb2_grpc
from tessera.worker_api import GenerateChunk, GenerateInput, Unavailable, WorkerInfo

_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


class GrpcWorkerClient:
    def __init__(self, address: str, idle_timeout_s: float = 300.0) -> None:
        """idle_timeout_s: longest wait for the next message of a stream (queueing and prefill
        included) before the worker is taken for failed; a long healthy stream never hits it."""
        self.address = address
        self.idle_timeout_s = idle_timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._stub_obj: worker_pb2_grpc.WorkerStub | None = None

    @property
    def _stub(self) -> worker_pb2_grpc.WorkerStub:
        """Created on first use, inside the event loop that will drive it (grpc.aio binds to it)."""
        if self._stub_obj is None:
            self._channel = grpc.aio.insecure_channel(self.address, options=_OPTIONS)
            self._stub_obj = worker_pb2_grpc.WorkerStub(self._channel)
        return self._stub_obj

    async def generate(self, request: GenerateInput) -> AsyncIterator[GenerateChunk]:
        request_id = ("x-request-id", logs.request_id.get() or request.request_id)
        call = self._stub.Generate(convert.generate_request_to_proto(request),
                                   metadata=cluster_auth.metadata(request_id))
        try:
            while True:    # no deadline on the whole stream: a bound on the wait for each message
                try:       # asyncio.timeout, not wait_for: on Python 3.11 wait_for makes a task per message
                    async with asyncio.timeout(self.idle_timeout_s):
                        msg = await call.read()
                except TimeoutError:
                    raise Unavailable(f"worker {self.address} sent nothing for {self.idle_timeout_s:.0f} s") from None
                if msg is grpc.aio.EOF:
                    return
                yield convert.chunk_from_proto(msg)
        except grpc.aio.AioRpcError as e:
            raise convert.error_from_status(e.code(), e.details()) from None
        finally:
            call.cancel()  # no-op when finished; aborts the request in the worker otherwise

    async def abort(self, request_id: str) -> None:
        await self._stub.Abort(worker_pb2.AbortRequest(request_id=request_id), timeout=5,
                               metadata=cluster_auth.metadata())

    async def info(self, timeout_s: float = 5.0) -> WorkerInfo:
        try:
            reply = await self._stub.Info(worker_pb2.InfoRequest(), timeout=timeout_s,
                                          metadata=cluster_auth.metadata())
            return convert.info_from_proto(reply)
        except grpc.aio.AioRpcError as e:
            raise convert.error_from_status(e.code(), e.details()) from None

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel, self._stub_obj = None, None
