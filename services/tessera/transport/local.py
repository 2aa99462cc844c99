"""The in-process twin of the M2N transport: endpoints in one process share a Fabric, and a
send copies straight into the receiver's slot (the same Mailbox the socket backends fill)."""
from __future__ import annotations

import torch

from tessera.transport.base import ERROR, Mailbox, Tag, TransportError, tensor_bytes


class Fabric:
    """Registry of the endpoints of one in-process deployment."""

    def __init__(self, slots: int = 2) -> None:
        self.slots = slots
        self.mailboxes: dict[str, Mailbox] = {}

    def endpoint(self, name: str) -> "LocalTransport":
        if name in self.mailboxes:
            raise ValueError(f"endpoint {name} exists")
        self.mailboxes[name] = Mailbox(self.slots)
        return LocalTransport(self, name)


class LocalTransport:
    def __init__(self, fabric: Fabric, name: str) -> None:
        self.fabric = fabric
        self.name = name

    def send(self, dst: str, tag: Tag, tensor: torch.Tensor, error: bool = False) -> None:
        box = self.fabric.mailboxes.get(dst)
        if box is None:
            raise TransportError(f"unknown endpoint {dst}")
        box.put(self.name, tag, tensor.dtype, tuple(tensor.shape), tensor_bytes(tensor),
                flags=ERROR if error else 0)

    def recv(self, src: str, tag: Tag, timeout_s: float = 30.0) -> torch.Tensor:
        return self.fabric.mailboxes[self.name].get(src, tag, timeout_s)

    def release(self, src: str, tag: Tag) -> None:
        self.fabric.mailboxes[self.name].release(src, tag)

    def take_any(self, src: str, direction: int, micro_batch: int, timeout_s: float = 30.0):
        return self.fabric.mailboxes[self.name].take_any(src, direction, micro_batch, timeout_s)

    def reset(self, src: str) -> None:
        self.fabric.mailboxes[self.name].reset(src)

    def metadata_for(self, peer: str) -> bytes:
        return b""   # endpoints of one Fabric find each other by name

    def connect(self, peer: str, metadata: bytes) -> None:
        if peer not in self.fabric.mailboxes:
            raise TransportError(f"unknown endpoint {peer}")

    def close(self) -> None:
        self.fabric.mailboxes[self.name].close()
