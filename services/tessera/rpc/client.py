"""GrpcWorkerClient: the gateway's side of the Worker service (WorkerClient interface)."""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator

import grpc

from tessera import logs, mtls, tracing
from tessera.rpc import convert, options
from tessera.rpc.v1 import worker_pb2, worker_pb2_grpc
from tessera.worker_api import (GenerateChunk, GenerateInput, InvalidRequest, Misconfigured, Tokenized, TokenizeInput,
                                Unavailable, WorkerError, WorkerInfo)

# Statuses no retry on the same worker fixes: it refuses this gateway (its role may not call it,
# an RPC it lacks, credentials it does not take). A certificate of another CA fails the TLS
# handshake instead: UNAVAILABLE, the path of a worker that is down. The Worker service never answers a
# request with one of them (convert.error_to_status), so each means a configuration error.
_REFUSALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
             grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED)


def _error(code: grpc.StatusCode, details: str | None) -> WorkerError:
    """A failed call's status as the WorkerError the gateway acts on."""
    if code in _REFUSALS:
        return Misconfigured(f"the worker refuses this gateway ({code.name}: {details})", code.name)
    return convert.error_from_status(code, details)


class GrpcWorkerClient:
    def __init__(self, address: str, idle_timeout_s: float = 300.0) -> None:
        """idle_timeout_s: longest wait for the next message of a stream (queueing and prefill
        included) before the worker is taken for failed; a long healthy stream never hits it."""
        self.address = address
        self.idle_timeout_s = idle_timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._stub_obj: worker_pb2_grpc.WorkerStub | None = None
        self._session: _Session | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._no_session = False   # the worker predates Session: every generation uses Generate

    @property
    def _stub(self) -> worker_pb2_grpc.WorkerStub:
        """Created on first use, inside the event loop that drives it: grpc.aio binds a channel
        to that loop, so a client used from another loop (asyncio.run twice) gets a channel, and
        a session, of its own there; the old ones went with their loop."""
        loop = asyncio.get_running_loop()
        if self._stub_obj is None or self._loop is not loop:
            self._channel = mtls.aio_channel(
                self.address, "worker", options.LARGE_MESSAGES + options.RECONNECT + options.keepalive())
            self._stub_obj, self._loop, self._session = worker_pb2_grpc.WorkerStub(self._channel), loop, None
        return self._stub_obj

    async def generate(self, request: GenerateInput) -> AsyncIterator[GenerateChunk]:
        """One generation over this client's session (worker.proto's Session): the worker sends
        one message per engine step for all of them, not one per request. A worker of an older
        version has no Session; when a session fails with an error of no known kind before the
        worker said anything, the worker is asked why (_refusal): one that lacks Session gets one
        Generate stream per request, as those workers expect; one that refuses this gateway
        (Misconfigured) is reported as such. With tracing on, the call is a "route" span naming
        the worker, and the worker's spans are its children (the carrier)."""
        span, carrier = tracing.client_span("route", self.address)
        error: BaseException | None = None
        try:
            async with contextlib.aclosing(self._generate(request, carrier)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except BaseException as e:
            error = e
            raise
        finally:
            tracing.end(span, error if isinstance(error, Exception) else None)

    async def _generate(self, request: GenerateInput, carrier: dict) -> AsyncIterator[GenerateChunk]:
        if not self._no_session:
            session = self._session_now()
            try:
                async for chunk in self._over_session(session, request, carrier):
                    yield chunk
                return
            except WorkerError as e:   # UNIMPLEMENTED, or INTERNAL (see _refusal): no known kind
                unknown = type(e) is WorkerError or isinstance(e, Misconfigured) and e.grpc_status == "UNIMPLEMENTED"
                refusal = await self._refusal() if unknown and not session.answered else None
                if refusal is None:
                    raise
                if refusal.grpc_status != "UNIMPLEMENTED":
                    raise refusal from None
                self._no_session = True
        async for chunk in self._over_generate(request, carrier):
            yield chunk

    async def _over_session(self, session: _Session, request: GenerateInput,
                            carrier: dict) -> AsyncIterator[GenerateChunk]:
        q = session.start(request, logs.request_id.get() or request.request_id, carrier)
        finished = False
        try:
            while not finished:
                try:
                    item = await self._next(q.get())
                except Unavailable:
                    if session.silent_s() >= self.idle_timeout_s:
                        session.abandon()   # a hung stream: its other requests fail over too, the next opens a new one
                    raise
                if isinstance(item, WorkerError):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
        finally:
            session.end(request.request_id, abort=not finished)

    async def _refusal(self) -> Misconfigured | None:
        """Whether the worker refuses Session (UNIMPLEMENTED: it lacks it; UNAUTHENTICATED...: it
        refuses this gateway), asked on a session of its own that sends nothing (a worker with
        Session ends it at once). The failed session's status cannot tell: gRPC reports a stream
        whose server refused it while requests were still being written as INTERNAL."""
        try:
            async for _ in self._stub.Session(iter(()), timeout=5):
                pass
        except grpc.aio.AioRpcError as e:
            refusal = _error(e.code(), e.details())
            return refusal if isinstance(refusal, Misconfigured) else None
        return None

    async def _over_generate(self, request: GenerateInput, carrier: dict) -> AsyncIterator[GenerateChunk]:
        request_id = ("x-request-id", logs.request_id.get() or request.request_id)
        call = self._stub.Generate(convert.generate_request_to_proto(request),
                                   metadata=(request_id, *carrier.items()))
        try:
            while (msg := await self._next(call.read())) is not grpc.aio.EOF:
                yield convert.chunk_from_proto(msg)
        except grpc.aio.AioRpcError as e:
            raise _error(e.code(), e.details()) from None
        finally:
            call.cancel()  # no-op when finished; aborts the request in the worker otherwise

    async def _next(self, message):
        """No deadline on a whole stream: a bound on the wait for each message (asyncio.timeout,
        not wait_for: on Python 3.11 wait_for makes a task per message)."""
        try:
            async with asyncio.timeout(self.idle_timeout_s):
                return await message
        except TimeoutError:
            raise Unavailable(f"worker {self.address} sent nothing for {self.idle_timeout_s:.0f} s") from None

    def _session_now(self) -> _Session:
        stub = self._stub     # first: in a new event loop it drops the old loop's session
        if self._session is None or self._session.closed:
            self._session = _Session(stub, self.address)
        return self._session

    async def abort(self, request_id: str) -> None:
        await self._stub.Abort(worker_pb2.AbortRequest(request_id=request_id), timeout=5)

    async def info(self, timeout_s: float = 5.0) -> WorkerInfo:
        try:
            reply = await self._stub.Info(worker_pb2.InfoRequest(), timeout=timeout_s)
            return convert.info_from_proto(reply)
        except grpc.aio.AioRpcError as e:
            raise _error(e.code(), e.details()) from None

    async def tokenize(self, request: TokenizeInput, timeout_s: float = 30.0) -> Tokenized:
        try:
            reply = await self._stub.Tokenize(convert.tokenize_request_to_proto(request), timeout=timeout_s)
            return convert.tokenized_from_proto(reply)
        except grpc.aio.AioRpcError as e:
            raise _error(e.code(), e.details()) from None

    async def detokenize(self, token_ids: tuple[int, ...], timeout_s: float = 30.0) -> str:
        try:
            reply = await self._stub.Detokenize(worker_pb2.DetokenizeRequest(token_ids=list(token_ids)),
                                                timeout=timeout_s)
            return reply.text
        except grpc.aio.AioRpcError as e:
            raise _error(e.code(), e.details()) from None

    async def close(self) -> None:
        if self._loop is not asyncio.get_running_loop():   # made under another loop: gone with it
            self._channel = self._stub_obj = self._session = self._loop = None
            return
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._channel is not None:
            await self._channel.close()
            self._channel, self._stub_obj = None, None


class _Session:
    """One Session stream to a worker, shared by the generations of a client: requests and
    aborts go out through a queue; a reader hands each update to its request's queue. When the
    stream ends or fails (the worker died, drained or restarted), every open request gets
    Unavailable, and the client's next generation opens a new session."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub, address: str) -> None:
        self.address, self.closed = address, False
        self.answered = False   # the worker has sent a message
        self._last_message = time.monotonic()
        self._outgoing: asyncio.Queue = asyncio.Queue()
        self._open: dict[str, asyncio.Queue] = {}
        self._call = stub.Session(self._requests())
        self._reader = asyncio.create_task(self._read())

    def start(self, request: GenerateInput, log_id: str, carrier: dict | None = None) -> asyncio.Queue:
        if request.request_id in self._open:
            raise InvalidRequest(f"request id {request.request_id} is already running", "request_id")
        q: asyncio.Queue = asyncio.Queue()
        self._open[request.request_id] = q
        self._outgoing.put_nowait(convert.session_generate(request, log_id, carrier))
        return q

    def end(self, request_id: str, abort: bool) -> None:
        """The caller stopped reading; abort: it did so before the request finished."""
        self._open.pop(request_id, None)
        if abort and not self.closed:
            self._outgoing.put_nowait(convert.session_abort(request_id))

    async def _requests(self):
        while True:
            yield await self._outgoing.get()

    async def _read(self) -> None:
        status, reason = None, f"worker {self.address} ended the session"
        try:
            async for msg in self._call:
                self.answered, self._last_message = True, time.monotonic()
                for u in msg.updates:
                    q = self._open.get(u.request_id)
                    if q is None:
                        continue
                    try:
                        q.put_nowait(convert.update_from_proto(u))
                    except Exception as e:   # one malformed update ends its own request only
                        q.put_nowait(WorkerError(f"bad update from worker {self.address}: {type(e).__name__}"))
        except grpc.aio.AioRpcError as e:
            status = e.code(), e.details()
        except asyncio.CancelledError:
            reason = f"session with worker {self.address} closed"
            raise
        finally:
            self.closed = True
            for q in self._open.values():   # an exception of its own for each request
                q.put_nowait(_error(*status) if status else Unavailable(reason))

    def silent_s(self) -> float:
        """Seconds since the worker last sent anything on this session."""
        return time.monotonic() - self._last_message

    def abandon(self) -> None:
        """Give up on the stream: the reader ends and fails every open request (Unavailable)."""
        self.closed = True
        self._call.cancel()

    async def close(self) -> None:
        self.closed = True
        self._call.cancel()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
