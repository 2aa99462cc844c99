"""This process's certificate and what every internal link does with it: gRPC servers demand a
client certificate from the deployment's CA and check its role against names.CALLERS; gRPC
clients check the server's certificate names the service they want; the TCP M2N transport
does the same with Python's ssl. The directory comes from $TESSERA_TLS_DIR (ca.crt, tls.crt,
tls.key: certs.py); without it links are plaintext, which a process allows only on loopback
unless TESSERA_ALLOW_INSECURE=1 (a test rig, or a network the operator secures otherwise)."""
from __future__ import annotations

import contextlib
import datetime
import inspect
import ipaddress
import logging
import os
import pathlib
import socket
import ssl
from dataclasses import dataclass

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature

from tessera.config import ConfigError
from tessera.mtls.certs import CA_FILE, CERT_FILE, KEY_FILE
from tessera.mtls.names import CALLERS, ROLES, parse_spiffe_id, service_host, service_of_method

ENV = "TESSERA_TLS_DIR"
INSECURE_ENV = "TESSERA_ALLOW_INSECURE"
log = logging.getLogger("tessera.mtls")


@dataclass(frozen=True)
class Identity:
    directory: str
    deployment: str
    role: str
    ca: bytes
    cert: bytes
    key: bytes

    def host(self, service: str) -> str:
        return service_host(self.deployment, service)


_cache: dict[str, Identity] = {}


def identity() -> Identity | None:
    """This process's identity from $TESSERA_TLS_DIR, read once per directory; None without it.
    A directory that is not a usable identity is a ConfigError naming what is wrong."""
    directory = os.environ.get(ENV)
    if not directory:
        return None
    if directory not in _cache:
        _cache[directory] = load(directory)
    return _cache[directory]


def load(directory: str | os.PathLike) -> Identity:
    """The identity in a certificate directory (ca.crt, tls.crt, tls.key)."""
    d = pathlib.Path(directory)
    try:
        ca, cert, key = ((d / f).read_bytes() for f in (CA_FILE, CERT_FILE, KEY_FILE))
    except OSError as e:
        raise ConfigError(f"{ENV}={d}: {e.strerror}: {e.filename}") from None
    try:
        leaf = x509.load_pem_x509_certificate(cert)
        uris = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value \
            .get_values_for_type(x509.UniformResourceIdentifier)
    except (ValueError, x509.ExtensionNotFound) as e:
        raise ConfigError(f"{d / CERT_FILE}: not a Tessera role certificate ({e})") from None
    ids = [parsed for parsed in map(parse_spiffe_id, uris) if parsed]
    if len(ids) != 1:
        raise ConfigError(f"{d / CERT_FILE}: needs one URI SAN spiffe://<deployment>.tessera/<role>, has {uris}")
    _check_usable(d, leaf, ca, key)
    return Identity(str(d), ids[0][0], ids[0][1], ca, cert, key)


def _check_usable(d: pathlib.Path, leaf: x509.Certificate, ca_pem: bytes, key_pem: bytes) -> None:
    """A certificate that could never complete a handshake is a start-up error (exit 78), not a
    process that says it is ready and then fails every link: its key must be its own, one of
    ca.crt's CAs must have issued it, and it must be valid now."""
    from cryptography.hazmat.primitives import serialization
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
        cas = x509.load_pem_x509_certificates(ca_pem)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{d}: unreadable key or CA ({e})") from None
    if key.public_key() != leaf.public_key():
        raise ConfigError(f"{d / KEY_FILE} is not the key of {d / CERT_FILE}")
    if not any(_issued_by(leaf, ca) for ca in cas):
        raise ConfigError(f"{d / CERT_FILE} was not issued by a CA in {d / CA_FILE}")
    now = datetime.datetime.now(datetime.timezone.utc)
    if not leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc:
        raise ConfigError(f"{d / CERT_FILE} is valid from {leaf.not_valid_before_utc:%Y-%m-%d %H:%M} to "
                          f"{leaf.not_valid_after_utc:%Y-%m-%d %H:%M} UTC, not now")


def _issued_by(leaf: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        leaf.verify_directly_issued_by(ca)
        return True
    except (ValueError, TypeError, InvalidSignature):
        return False


@contextlib.contextmanager
def holding(directory: str | os.PathLike):
    """This process calls (and serves) as the identity in `directory` until the block ends (a
    tool that talks to a deployment's internal services as one of its roles)."""
    old = os.environ.get(ENV)
    os.environ[ENV] = str(directory)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old


def check_bind(host: str) -> None:
    """Plaintext links only on loopback, unless the operator says otherwise."""
    if identity() is not None or os.environ.get(INSECURE_ENV) == "1":
        return
    if not loopback_only(host):
        raise ConfigError(f"binding {host} without TLS: set {ENV} (`tessera certs`) or {INSECURE_ENV}=1")


# ---- gRPC ------------------------------------------------------------------------------------

# Exclusive ports: gRPC sets SO_REUSEPORT by default, so a second server on a port in use would
# start without error and take half of its connections.
SERVER_OPTIONS = [("grpc.so_reuseport", 0)]


def add_port(server, host: str, port: int) -> int:
    """Bind the server (TLS with client certificates when this process has an identity); a
    port in use is a ConfigError naming it. Returns the bound port."""
    check_bind(host)
    ident = identity()
    try:
        if ident is None:
            bound = server.add_insecure_port(f"{host}:{port}")
        else:
            creds = grpc.ssl_server_credentials([(ident.key, ident.cert)], root_certificates=ident.ca,
                                                require_client_auth=True)
            bound = server.add_secure_port(f"{host}:{port}", creds)
    except RuntimeError as e:
        bound, why = 0, e
    else:
        why = None
    if not bound:
        raise ConfigError(f"cannot listen on {host}:{port}: port in use or address not available"
                          + (f" ({why})" if why else ""))
    return bound


def _channel_args(address: str, service: str, options, ident: Identity | None
                  ) -> tuple[list, grpc.ChannelCredentials | None]:
    ident = ident or identity()
    if ident is None:
        return list(options), None
    creds = grpc.ssl_channel_credentials(root_certificates=ident.ca, private_key=ident.key,
                                         certificate_chain=ident.cert)
    return [*options, ("grpc.ssl_target_name_override", ident.host(service))], creds


def aio_channel(address: str, service: str, options=(), ident: Identity | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to a peer that must hold a certificate serving `service`, with this
    process's identity (or `ident`)."""
    opts, creds = _channel_args(address, service, options, ident)
    return grpc.aio.secure_channel(address, creds, options=opts) if creds else \
        grpc.aio.insecure_channel(address, options=opts)


def channel(address: str, service: str, options=(), ident: Identity | None = None) -> grpc.Channel:
    """The blocking twin of aio_channel."""
    opts, creds = _channel_args(address, service, options, ident)
    return grpc.secure_channel(address, creds, options=opts) if creds else grpc.insecure_channel(address, options=opts)


def _caller_role(context) -> str | None:
    """The role in the client certificate's SPIFFE id (the handshake already checked the CA)."""
    auth = context.auth_context() or {}
    for value in [*auth.get("x509_subject_alternative_name", ()), *auth.get("peer_spiffe_id", ())]:
        parsed = parse_spiffe_id(value.decode(errors="replace"))
        if parsed and parsed[0] == identity().deployment:
            return parsed[1]
    return None


def _denial(method: str, context) -> str | None:
    if identity() is None:
        return None
    role, allowed = _caller_role(context), CALLERS.get(service_of_method(method), ())
    if role in allowed:
        return None
    return f"{role or 'a certificate without a role of this deployment'} may not call {method}"


_HANDLERS = {(False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
             (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
             (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
             (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler)}


def _guarded(handler, method: str) -> bool:
    """Whether a handler needs the role check: not for a service every role of the deployment
    may call (health), which the handshake already settled; it then runs exactly as registered."""
    return handler is not None and identity() is not None and CALLERS.get(service_of_method(method)) != ROLES


def _rebuilt(handler, behaviour):
    _, make = _HANDLERS[handler.request_streaming, handler.response_streaming]
    return make(behaviour, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class ServerInterceptor(grpc.ServerInterceptor):
    """Blocking servers (the expert node): a caller whose role may not call the method ends
    PERMISSION_DENIED before its handler runs."""
    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if not _guarded(handler, details.method):
            return handler
        inner = getattr(handler, _HANDLERS[handler.request_streaming, handler.response_streaming][0])

        def guarded(request, context):
            why = _denial(details.method, context)
            if why:
                log.warning("refused: %s", why)
                context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
            return inner(request, context)
        return _rebuilt(handler, guarded)


class AioServerInterceptor(grpc.aio.ServerInterceptor):
    """grpc.aio servers (workers, attention nodes, draft workers, pipeline stages): the same rule."""
    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if not _guarded(handler, details.method):
            return handler
        inner = getattr(handler, _HANDLERS[handler.request_streaming, handler.response_streaming][0])

        async def refuse(context):
            why = _denial(details.method, context)
            if why:
                log.warning("refused: %s", why)
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)

        if handler.response_streaming:
            async def guarded(request, context):
                await refuse(context)
                result = inner(request, context)   # an async or plain generator, or a coroutine
                if hasattr(result, "__aiter__"):
                    async for item in result:
                        yield item
                elif inspect.isawaitable(result):
                    await result
                else:
                    for item in result:
                        yield item
        else:
            async def guarded(request, context):
                await refuse(context)
                result = inner(request, context)
                return await result if inspect.isawaitable(result) else result
        return _rebuilt(handler, guarded)


# ---- TCP (the M2N transport) ------------------------------------------------------------------

def ssl_contexts() -> tuple[ssl.SSLContext, ssl.SSLContext] | None:
    """(server, client) contexts for M2N links, both demanding a certificate from the CA; None
    without an identity."""
    ident = identity()
    if ident is None:
        return None
    pem = pathlib.Path(ident.directory)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)     # checks the server's name
    for ctx in (server, client):
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_cert_chain(pem / CERT_FILE, pem / KEY_FILE)
        ctx.load_verify_locations(cafile=str(pem / CA_FILE))
        ctx.verify_mode = ssl.CERT_REQUIRED
    return server, client


def m2n_host() -> str:
    return identity().host("m2n")


def peer_role(sock: ssl.SSLSocket) -> str | None:
    """The role in the peer certificate's SPIFFE id, if it belongs to this deployment."""
    cert = sock.getpeercert() or {}
    for kind, value in cert.get("subjectAltName", ()):
        parsed = parse_spiffe_id(value) if kind == "URI" else None
        if parsed and parsed[0] == identity().deployment:
            return parsed[1]
    return None


def loopback_only(host: str) -> bool:
    """Whether `host` resolves to loopback addresses only (used for the plaintext check)."""
    try:
        return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
    except (OSError, ValueError):
        return False
