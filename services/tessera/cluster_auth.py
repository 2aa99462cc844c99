"""The shared cluster secret that internal links prove they know: gRPC calls between gateway,
workers, attention and expert nodes carry it as metadata, and each M2N TCP link opens with an
HMAC of it. The secret comes from --cluster-secret-file, else $TESSERA_CLUSTER_SECRET; with
neither, auth is off (a single-machine `tessera serve`). `tessera up` always sets one."""
from __future__ import annotations

import hashlib
import hmac
import os

import grpc

ENV = "TESSERA_CLUSTER_SECRET"
METADATA_KEY = "x-tessera-cluster-token"
PROOF_SIZE = 32
_EXEMPT = ("/grpc.health.v1.Health/",)     # probes (compose, Kubernetes) carry no secret
_file_secret: str | None = None


def use_secret_file(path: str | None) -> None:
    """Take the secret from this file (surrounding whitespace stripped); None keeps the env var."""
    global _file_secret
    if path is not None:
        with open(path) as f:
            _file_secret = f.read().strip()
        if not _file_secret:
            raise ValueError(f"cluster secret file {path} is empty")


def secret() -> str | None:
    return _file_secret or os.environ.get(ENV) or None


def metadata(*pairs: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    """Call metadata for an internal gRPC call: `pairs` plus the token when a secret is set."""
    s = secret()
    return (*pairs, (METADATA_KEY, s)) if s else tuple(pairs)


def _allowed(details) -> bool:
    s = secret()
    if s is None or details.method.startswith(_EXEMPT):
        return True
    token = dict(details.invocation_metadata or ()).get(METADATA_KEY, "")
    return hmac.compare_digest(token.encode(), s.encode())


_HANDLERS = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
_DENIED = "missing or wrong cluster token"


def _refusal(handler, deny):
    """A handler of the same kind as `handler` that only refuses."""
    make = _HANDLERS[handler.request_streaming, handler.response_streaming]
    return make(deny, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class ServerInterceptor(grpc.ServerInterceptor):
    """Sync servers (the expert node): calls without the token end UNAUTHENTICATED."""
    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or _allowed(details):
            return handler

        def deny(_, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)
        return _refusal(handler, deny)


class AioServerInterceptor(grpc.aio.ServerInterceptor):
    """grpc.aio servers (workers, attention nodes): the same rule."""
    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or _allowed(details):
            return handler

        async def deny(_, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)
        return _refusal(handler, deny)


def peer_proof(sender: str, receiver: str) -> bytes:
    """What an M2N link's first frame carries: binds the secret to this (sender, receiver)
    pair; zeros when auth is off."""
    s = secret()
    if s is None:
        return bytes(PROOF_SIZE)
    return hmac.new(s.encode(), f"m2n {sender} -> {receiver}".encode(), hashlib.sha256).digest()


def check_proof(sender: str, receiver: str, proof: bytes) -> bool:
    return secret() is None or hmac.compare_digest(proof, peer_proof(sender, receiver))
