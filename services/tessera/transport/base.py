"""The Transport interface and the receive-side mailbox every backend shares.

A message is (Tag, tensor): Tag = (step, micro_batch, layer, direction). A receiver keeps
`slots` receive buffers per (sender, direction), one per in-flight micro-batch: a message for
micro-batch i lands in slot i % slots, and waits until the previous occupant was released, so
a buffer is never overwritten before its consumer is done (MegaScale-Infer's "buffer free"
step). recv() checks the tag: a message for another step or layer is a protocol error, never
silently used. Buffers are allocated once and grown only when a larger message arrives.
A peer that cannot answer a message sends an error in its place: the header's ERROR flag set,
the reason as the payload; the receiver's recv() raises PeerError with that reason.
"""
from __future__ import annotations

import os
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

DISPATCH, COMBINE = 0, 1
DTYPES = {0: torch.float32, 1: torch.bfloat16, 2: torch.float16, 3: torch.int64, 4: torch.int32, 5: torch.uint8}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
ELEMENT_SIZE = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in DTYPES.values()}
HEADER = struct.Struct("<qiiBBBBQ")   # step, micro_batch, layer, direction, dtype, ndim, flags, nbytes
MAX_NDIM = 8
ERROR = 1                              # flag: the payload is the reason (utf-8) the peer failed this tag
MAX_REASON = 1024


@dataclass(frozen=True)
class Tag:
    step: int
    micro_batch: int
    layer: int
    direction: int


class TransportError(RuntimeError):
    """A malformed, stale or unexpected message, or a peer that did not answer in time."""


class PeerError(TransportError):
    """The peer answered a tag with an error (it rejected what it was sent)."""


class Transport(Protocol):
    name: str

    def send(self, dst: str, tag: Tag, tensor: torch.Tensor, error: bool = False) -> None: ...

    def recv(self, src: str, tag: Tag, timeout_s: float = 30.0) -> torch.Tensor: ...

    def release(self, src: str, tag: Tag) -> None: ...

    def take_any(self, src: str, direction: int, micro_batch: int,
                 timeout_s: float = 30.0) -> tuple[Tag, torch.Tensor]: ...

    def reset(self, src: str) -> None: ...

    def metadata_for(self, peer: str) -> bytes: ...

    def connect(self, peer: str, metadata: bytes) -> None: ...

    def close(self) -> None: ...


def dispatch(t: Transport, tag: Tag, parts: dict[str, torch.Tensor]) -> None:
    """Send one tensor to each named receiver."""
    for dst, tensor in parts.items():
        t.send(dst, tag, tensor)


def send_error(t: Transport, dst: str, tag: Tag, reason: str) -> None:
    """Answer `tag` with an error: dst's recv of that tag raises PeerError(reason)."""
    payload = reason.encode(errors="replace")[:MAX_REASON]
    t.send(dst, tag, torch.frombuffer(bytearray(payload), dtype=torch.uint8), error=True)


def combine(t: Transport, tag: Tag, sources: list[str], timeout_s: float = 30.0) -> dict[str, torch.Tensor]:
    """Receive one tensor from each named sender (copies: the slots are released at once)."""
    out = {}
    for src in sources:
        out[src] = t.recv(src, tag, timeout_s).clone()
        t.release(src, tag)
    return out


class _Slot:
    def __init__(self) -> None:
        with torch.inference_mode(False):   # a plain tensor, even if created under inference_mode
            self.buffer = torch.empty(0, dtype=torch.uint8)
        self.tag: Tag | None = None
        self.flags = 0
        self.dtype = torch.float32
        self.shape: tuple[int, ...] = ()
        self.views: dict[tuple[torch.dtype, tuple[int, ...]], torch.Tensor] = {}

    def view(self) -> torch.Tensor:
        """The held message as a tensor over the slot's buffer. Views are cached: building one
        costs several torch calls, and a decode step sends the same shapes again and again."""
        key = (self.dtype, self.shape)
        view = self.views.get(key)
        if view is None:
            if len(self.views) >= 32:
                self.views.clear()
            view = self.views[key] = self.buffer[:_nbytes(*key)].view(self.dtype).view(self.shape)
        return view


class Mailbox:
    """Receive slots of one endpoint, keyed by (sender, direction, micro_batch % slots).

    `poll`, when given, is called while a reader waits: backends whose messages arrive only
    when someone drives the network (NIXL without a progress thread) deliver them from it;
    it returns whether it delivered anything. `on_free(src, [(direction, index), ...])`, when
    given, hears of every slot freed (released, reset, or an error consumed by a reader):
    backends whose senders wait for credits (NIXL) return them from it."""

    def __init__(self, slots: int = 2, poll=None,
                 on_free: Callable[[str, list[tuple[int, int]]], None] | None = None) -> None:
        if slots < 1:
            raise ValueError("slots must be >= 1")
        self.slots = slots
        self._slots: dict[tuple[str, int, int], _Slot] = {}
        self._epochs: dict[str, int] = {}
        self._cond = threading.Condition()
        self._poll = poll
        self._on_free = on_free
        self.closed = False

    def _slot(self, key: tuple[str, int, int]) -> _Slot:
        slot = self._slots.get(key)
        if slot is None:   # a new slot allocates: never on the hot path
            slot = self._slots[key] = _Slot()
        return slot

    def _key(self, src: str, tag: Tag) -> tuple[str, int, int]:
        return src, tag.direction, tag.micro_batch % self.slots

    def put(self, src: str, tag: Tag, dtype: torch.dtype, shape: tuple[int, ...], payload,
            timeout_s: float = 30.0, flags: int = 0) -> None:
        """Copy payload (bytes-like or uint8 tensor) into its slot once that slot is free."""
        nbytes = len(payload) if not isinstance(payload, torch.Tensor) else payload.numel()
        if nbytes != _nbytes(dtype, shape):
            raise TransportError(f"message {tag} from {src}: {nbytes} bytes for shape {shape} {dtype}")
        with self._cond:
            slot = self._slot(self._key(src, tag))
            if not self._cond.wait_for(lambda: slot.tag is None or self.closed, timeout_s):
                raise TransportError(f"slot for {tag} from {src} still busy after {timeout_s} s")
            # Slots are plain tensors whoever sends (a sender may run under inference_mode).
            with torch.inference_mode(False), torch.no_grad():
                if slot.buffer.numel() < nbytes:
                    slot.buffer, slot.views = torch.empty(nbytes, dtype=torch.uint8), {}
                slot.buffer[:nbytes].copy_(_as_uint8(payload))
            slot.tag, slot.flags, slot.dtype, slot.shape = tag, flags, dtype, shape
            self._cond.notify_all()

    def _spin(self, slot: _Slot, epoch: int, src: str, deadline: float) -> None:
        """Drive the network until the slot fills (or a reset, close or the deadline), without
        the lock: a tight loop, since the transfer protocol advances only while we poll."""
        idle = 0
        while slot.tag is None and not self.closed and self._epochs.get(src, 0) == epoch:
            idle = 0 if self._poll() else idle + 1
            if idle and idle % 16 == 0:
                if time.monotonic() > deadline:
                    return
                pause = backoff_s(idle)
                time.sleep(pause) if pause else os.sched_yield()

    def attach(self, src: str, direction: int, index: int, buffer: torch.Tensor) -> None:
        """Use `buffer` (memory registered with a NIC) as one slot's storage."""
        with self._cond:
            slot = self._slot((src, direction, index))
            slot.buffer, slot.views = buffer, {}

    def mark(self, src: str, tag: Tag, dtype: torch.dtype, shape: tuple[int, ...], flags: int = 0) -> None:
        """A one-sided write already put the bytes into the slot's buffer: publish them."""
        with self._cond:
            slot = self._slots.get(self._key(src, tag))
            if slot is None or slot.tag is not None:
                raise TransportError(f"message {tag} from {src} landed in a busy or unknown slot")
            if _nbytes(dtype, shape) > slot.buffer.numel():
                raise TransportError(f"message {tag} from {src} overflows its slot")
            slot.tag, slot.flags, slot.dtype, slot.shape = tag, flags, dtype, shape
            self._cond.notify_all()

    def get(self, src: str, tag: Tag, timeout_s: float) -> torch.Tensor:
        """A view of the message's tensor; valid until release(src, tag)."""
        return self.take_any(src, tag.direction, tag.micro_batch, timeout_s, expect=tag)[1]

    def take_any(self, src: str, direction: int, micro_batch: int, timeout_s: float,
                 expect: Tag | None = None) -> tuple[Tag, torch.Tensor]:
        """Whatever message the slot holds, with its tag (a receiver that resynchronises after
        an error reads the step number from it). With `expect`, any other tag is an error.
        An error message is consumed here (its slot freed) and raised as PeerError."""
        key = (src, direction, micro_batch % self.slots)
        with self._cond:
            slot = self._slot(key)
            self._wait_filled(slot, src, timeout_s, expect or f"micro-batch {micro_batch} direction {direction}")
            if slot.flags & ERROR:
                tag, reason = slot.tag, bytes(slot.view().numpy()).decode(errors="replace")
                slot.tag = None
                self._cond.notify_all()
            elif expect is not None and slot.tag != expect:
                raise TransportError(f"expected {expect} from {src}, slot holds {slot.tag}")
            else:
                return slot.tag, slot.view()
        self._freed(src, [key[1:]])
        raise PeerError(f"{src} answered {tag} with an error: {reason}")

    def _wait_filled(self, slot: _Slot, src: str, timeout_s: float, what) -> None:
        """Wait (holding the lock, released while waiting) until the slot holds a message;
        raise on the deadline, on close, or when the link is reset meanwhile."""
        deadline = time.monotonic() + timeout_s
        epoch = self._epochs.get(src, 0)
        while slot.tag is None and not self.closed and self._epochs.get(src, 0) == epoch:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportError(f"no message {what} from {src} within {timeout_s:g} s")
            if self._poll is None:
                self._cond.wait(remaining)
                continue
            self._cond.release()
            try:
                self._spin(slot, epoch, src, deadline)
            finally:
                self._cond.acquire()
        if slot.tag is None:
            raise TransportError("transport closed" if self.closed else f"link from {src} was reset")

    def release(self, src: str, tag: Tag) -> None:
        with self._cond:
            slot = self._slots.get(self._key(src, tag))
            if slot is None or slot.tag != tag:
                raise TransportError(f"release of {tag} from {src}, which is not held")
            slot.tag = None
            self._cond.notify_all()
        self._freed(src, [self._key(src, tag)[1:]])

    def reset(self, src: str) -> None:
        """Drop every message held from `src` and wake its readers with an error."""
        with self._cond:
            self._epochs[src] = self._epochs.get(src, 0) + 1
            held = []
            for (sender, direction, index), slot in self._slots.items():
                if sender == src and slot.tag is not None:
                    slot.tag = None
                    held.append((direction, index))
            self._cond.notify_all()
        self._freed(src, held)

    def _freed(self, src: str, slots: list[tuple[int, int]]) -> None:
        """Tell the backend, outside our lock (its own lock may be held while it calls us)."""
        if self._on_free is not None and slots:
            self._on_free(src, slots)

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = ELEMENT_SIZE[dtype]
    for d in shape:
        n *= d
    return n


def backoff_s(idle_polls: int) -> float:
    """How long a polling reader sleeps between empty polls: not at all at first (the messages
    of a running step follow each other within milliseconds), then longer, so that an idle
    endpoint does not burn a core."""
    if idle_polls < 2000:
        return 0.0
    return 0.0002 if idle_polls < 2500 else 0.002


def pack_header(tag: Tag, tensor: torch.Tensor, flags: int = 0) -> bytes:
    """Fixed header + shape of one message: the only framing any backend puts on a tensor."""
    if tensor.dtype not in DTYPE_CODES or tensor.dim() > MAX_NDIM:
        raise TransportError(f"cannot send {tensor.dtype} tensor of {tensor.dim()} dims")
    nbytes = tensor.numel() * tensor.element_size()
    return HEADER.pack(tag.step, tag.micro_batch, tag.layer, tag.direction, DTYPE_CODES[tensor.dtype],
                       tensor.dim(), flags, nbytes) + struct.pack(f"<{tensor.dim()}q", *tensor.shape)


def unpack_fixed(data: bytes, src: str) -> tuple[int, ...]:
    """The fixed part of a header, checked before anything else is read."""
    if len(data) < HEADER.size:
        raise TransportError(f"short header from {src}")
    fields = HEADER.unpack_from(data)
    _, _, _, direction, code, ndim, flags, _ = fields
    if code not in DTYPES or ndim > MAX_NDIM or direction > 1 or flags & ~ERROR:
        raise TransportError(f"malformed header from {src}: dtype {code}, ndim {ndim}, direction {direction}, "
                             f"flags {flags:#x}")
    return fields


def unpack_header(data: bytes, src: str) -> tuple[Tag, torch.dtype, tuple[int, ...], int, int]:
    """(tag, dtype, shape, nbytes, flags) of a packed header; malformed ones raise TransportError."""
    step, mb, layer, direction, code, ndim, flags, nbytes = unpack_fixed(data, src)
    if len(data) != HEADER.size + 8 * ndim:
        raise TransportError(f"header from {src} has {len(data)} bytes for {ndim} dims")
    shape = struct.unpack_from(f"<{ndim}q", data, HEADER.size)
    if any(d < 0 for d in shape) or _nbytes(DTYPES[code], shape) != nbytes:
        raise TransportError(f"header from {src}: shape {shape} does not match {nbytes} bytes")
    return Tag(step, mb, layer, direction), DTYPES[code], shape, nbytes, flags


def _as_uint8(payload) -> torch.Tensor:
    if isinstance(payload, torch.Tensor):
        return payload
    if not len(payload):
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(payload, dtype=torch.uint8)


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view (contiguous copy only when needed)."""
    return tensor.contiguous().view(-1).view(torch.uint8)
