"""M2N transport over TCP sockets between processes: one connection per (sender, receiver),
frames of a fixed header, the shape, then the raw tensor bytes (no pickling). A reader thread
per incoming connection copies each frame into the receiver's Mailbox slot, waiting while the
slot is busy, so TCP flow control pushes back on a sender that runs ahead of its receiver.
Where the process holds a deployment certificate (mtls/), every link is TLS 1.3 with
certificates checked both ways: the dialer checks the listener's names the M2N service, the
listener that the dialer's role may send M2N messages. A connection must finish its handshake
within HANDSHAKE_S, at most MAX_HANDSHAKES wait at a time (more are closed unread), and
nothing is read from it before the handshake holds. Then the link opens with the sender's
name: only peers announced by the control plane (connect / add_peer) are read, and a frame
larger than a slot (capacity_bytes) closes the link before anything is allocated for it."""
from __future__ import annotations

import logging
import socket
import ssl
import struct
import threading

import torch

from tessera.mtls import links as mtls
from tessera.mtls.names import CALLERS
from tessera.transport.base import (ERROR, HEADER, Mailbox, Tag, TransportError, pack_header, tensor_bytes,
                                    unpack_fixed, unpack_header)

log = logging.getLogger("tessera.transport.tcp")
_HELLO = struct.Struct("<B")           # length of the sender's name, then the name
HANDSHAKE_S = 5.0
MAX_HANDSHAKES = 16


class TcpTransport:
    def __init__(self, name: str, host: str = "127.0.0.1", port: int = 0, slots: int = 2,
                 peers: dict[str, tuple[str, int]] | None = None, advertise: str | None = None,
                 capacity_bytes: int = 8 << 20) -> None:
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.mailbox = Mailbox(slots)
        self.peers = dict(peers or {})
        self._conns: dict[str, tuple[socket.socket, threading.Lock]] = {}
        self._conns_lock = threading.Lock()
        mtls.check_bind(host)
        self._tls = mtls.ssl_contexts()
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._server = socket.create_server((host, port))
        self.address = self._server.getsockname()[:2]
        self.advertise = advertise or self.address[0]
        self.rejected = 0
        threading.Thread(target=self._accept, name=f"tcp-accept-{name}", daemon=True).start()

    def add_peer(self, name: str, address: tuple[str, int]) -> None:
        self.peers[name] = address

    def metadata_for(self, peer: str) -> bytes:
        """What a peer needs to reach this endpoint: its listening address."""
        return f"{self.advertise}:{self.address[1]}".encode()

    def connect(self, peer: str, metadata: bytes) -> None:
        host, port = metadata.decode().rsplit(":", 1)
        self._drop(peer)
        self.peers[peer] = (host, int(port))

    def send(self, dst: str, tag: Tag, tensor: torch.Tensor, error: bool = False) -> None:
        header = pack_header(tag, tensor, ERROR if error else 0)
        payload = tensor_bytes(tensor).numpy()
        sock, lock = self._connection(dst)
        with lock:
            try:
                sock.sendall(header)
                sock.sendall(memoryview(payload))
            except OSError as e:
                self._drop(dst)
                raise TransportError(f"send to {dst} failed: {e}") from e

    def recv(self, src: str, tag: Tag, timeout_s: float = 30.0) -> torch.Tensor:
        return self.mailbox.get(src, tag, timeout_s)

    def release(self, src: str, tag: Tag) -> None:
        self.mailbox.release(src, tag)

    def take_any(self, src: str, direction: int, micro_batch: int, timeout_s: float = 30.0):
        return self.mailbox.take_any(src, direction, micro_batch, timeout_s)

    def reset(self, src: str) -> None:
        self.mailbox.reset(src)

    def close(self) -> None:
        self.mailbox.close()
        self._server.close()
        with self._conns_lock:
            for sock, _ in self._conns.values():
                sock.close()
            self._conns.clear()

    def _connection(self, dst: str) -> tuple[socket.socket, threading.Lock]:
        with self._conns_lock:
            if dst not in self._conns:
                if dst not in self.peers:
                    raise TransportError(f"unknown endpoint {dst}")
                try:
                    sock = socket.create_connection(self.peers[dst], timeout=10)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    if self._tls is not None:
                        sock = self._tls[1].wrap_socket(sock, server_hostname=mtls.m2n_host())
                except (OSError, ssl.SSLError) as e:
                    raise TransportError(f"cannot reach {dst} at {self.peers[dst]}: {e}") from e
                sock.settimeout(None)
                name = self.name.encode()[:255]
                sock.sendall(_HELLO.pack(len(name)) + name)
                self._conns[dst] = (sock, threading.Lock())
            return self._conns[dst]

    def _drop(self, dst: str) -> None:
        with self._conns_lock:
            conn = self._conns.pop(dst, None)
        if conn is not None:
            conn[0].close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return
            if not self._handshakes.acquire(blocking=False):
                self.rejected += 1
                sock.close()     # too many links still proving who they are
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._read, args=(sock,), daemon=True).start()

    def _read(self, sock: socket.socket) -> None:
        """Frames from one sender until it disconnects; a malformed frame closes only this link."""
        try:
            sock, src = self._hello(sock)
        except (ConnectionError, OSError, TransportError) as e:
            self.rejected += 1
            log.warning("refused an M2N link: %s", e)
            sock.close()
            return
        finally:
            self._handshakes.release()
        with sock:
            try:
                while True:
                    self._read_frame(sock, src)
            except (ConnectionError, OSError):
                return
            except TransportError as e:
                self.rejected += 1
                log.warning("rejected a message: %s", e)

    def _hello(self, sock: socket.socket) -> tuple[socket.socket, str]:
        """The (TLS) socket and the sender's name, once its certificate holds a role that may
        send M2N messages and it is a peer the control plane announced; all within HANDSHAKE_S."""
        sock.settimeout(HANDSHAKE_S)
        if self._tls is not None:
            try:
                sock = self._tls[0].wrap_socket(sock, server_side=True)   # takes over the descriptor
            except ssl.SSLError as e:
                raise TransportError(f"TLS handshake failed: {e.reason}") from None
        try:
            role = mtls.peer_role(sock) if self._tls is not None else None
            if self._tls is not None and role not in CALLERS["m2n"]:
                raise TransportError(f"a {role or 'foreign'} certificate may not open M2N links")
            (n,) = _HELLO.unpack(_read_exact(sock, _HELLO.size))
            src = _read_exact(sock, n).decode(errors="replace")
            if src not in self.peers:
                raise TransportError(f"link from unannounced peer {src!r}")
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        return sock, src

    def _read_frame(self, sock: socket.socket, src: str) -> None:
        fixed = _read_exact(sock, HEADER.size)
        ndim = unpack_fixed(fixed, src)[5]
        tag, dtype, shape, nbytes, flags = unpack_header(bytes(fixed + _read_exact(sock, 8 * ndim)), src)
        if nbytes > self.capacity_bytes:
            raise TransportError(f"{nbytes}-byte message from {src} exceeds the {self.capacity_bytes}-byte slot")
        self.mailbox.put(src, tag, dtype, shape, _read_exact(sock, nbytes), flags=flags)


def _read_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed")
        got += k
    return buf
