"""The Transport interface and the receive-side mailbox every backend shares.

A message is (Tag, tensor): Tag = (step, micro_batch, layer, direction). A receiver keeps
`slots` receive buffers per (sender, direction), one per in-flight micro-batch: a message for
micro-batch i lands in slot i % slots, and waits until the previous occupant was released, so
a buffer is never overwritten before its consumer is done (MegaScale-Infer's "buffer free"
step). recv() checks the tag: a message for another step or layer is a protocol error, never
silently used. Buffers are allocated once and grown only when a larger message arrives.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Protocol

import torch

DISPATCH, COMBINE = 0, 1
DTYPES = {0: torch.float32, 1: torch.bfloat16, 2: torch.float16, 3: torch.int64, 4: torch.int32}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class Tag:
    step: int
    micro_batch: int
    layer: int
    direction: int


class TransportError(RuntimeError):
    """A malformed, stale or unexpected message, or a peer that did not answer in time."""


class Transport(Protocol):
    name: str

    def send(self, dst: str, tag: Tag, tensor: torch.Tensor) -> None: ...

    def recv(self, src: str, tag: Tag, timeout_s: float = 30.0) -> torch.Tensor: ...

    def release(self, src: str, tag: Tag) -> None: ...

    def close(self) -> None: ...


def dispatch(t: Transport, tag: Tag, parts: dict[str, torch.Tensor]) -> None:
    """Send one tensor to each named receiver."""
    for dst, tensor in parts.items():
        t.send(dst, tag, tensor)


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
        self.dtype = torch.float32
        self.shape: tuple[int, ...] = ()


class Mailbox:
    """Receive slots of one endpoint, keyed by (sender, direction, micro_batch % slots)."""

    def __init__(self, slots: int = 2) -> None:
        if slots < 1:
            raise ValueError("slots must be >= 1")
        self.slots = slots
        self._slots: dict[tuple[str, int, int], _Slot] = {}
        self._cond = threading.Condition()
        self.closed = False

    def _key(self, src: str, tag: Tag) -> tuple[str, int, int]:
        return src, tag.direction, tag.micro_batch % self.slots

    def put(self, src: str, tag: Tag, dtype: torch.dtype, shape: tuple[int, ...], payload,
            timeout_s: float = 30.0) -> None:
        """Copy payload (bytes-like or uint8 tensor) into its slot once that slot is free."""
        nbytes = len(payload) if not isinstance(payload, torch.Tensor) else payload.numel()
        expected = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        if nbytes != expected:
            raise TransportError(f"message {tag} from {src}: {nbytes} bytes for shape {shape} {dtype}")
        with self._cond:
            slot = self._slots.setdefault(self._key(src, tag), _Slot())
            if not self._cond.wait_for(lambda: slot.tag is None or self.closed, timeout_s):
                raise TransportError(f"slot for {tag} from {src} still busy after {timeout_s} s")
            # Slots are plain tensors whoever sends (a sender may run under inference_mode).
            with torch.inference_mode(False), torch.no_grad():
                if slot.buffer.numel() < nbytes:
                    slot.buffer = torch.empty(nbytes, dtype=torch.uint8)
                slot.buffer[:nbytes].copy_(_as_uint8(payload))
            slot.tag, slot.dtype, slot.shape = tag, dtype, shape
            self._cond.notify_all()

    def get(self, src: str, tag: Tag, timeout_s: float) -> torch.Tensor:
        """A view of the message's tensor; valid until release(src, tag)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            slot = self._slots.setdefault(self._key(src, tag), _Slot())
            while slot.tag is None and not self.closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransportError(f"no message {tag} from {src} within {timeout_s} s")
                self._cond.wait(remaining)
            if slot.tag is None:
                raise TransportError("transport closed")
            if slot.tag != tag:
                raise TransportError(f"expected {tag} from {src}, slot holds {slot.tag}")
            nbytes = int(torch.Size(slot.shape).numel()) * torch.empty((), dtype=slot.dtype).element_size()
            return slot.buffer[:nbytes].view(slot.dtype).view(slot.shape)

    def release(self, src: str, tag: Tag) -> None:
        with self._cond:
            slot = self._slots.get(self._key(src, tag))
            if slot is None or slot.tag != tag:
                raise TransportError(f"release of {tag} from {src}, which is not held")
            slot.tag = None
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


def _as_uint8(payload) -> torch.Tensor:
    if isinstance(payload, torch.Tensor):
        return payload
    if not len(payload):
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(payload, dtype=torch.uint8)


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view (contiguous copy only when needed)."""
    return tensor.contiguous().view(-1).view(torch.uint8)
