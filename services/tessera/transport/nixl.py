"""M2N transport over NIXL (UCX): one-sided RDMA-style writes into the receiver's
pre-registered slots, each followed by a notification that carries the message header.

Every endpoint registers, per peer, one region of 2 directions x `slots` slots x `capacity`
bytes and hands the peer its agent metadata plus the region's address (`metadata_for`, sent
over the control channel). A sender writes micro-batch i into slot i % slots only after the
receiver has released that slot's previous message: `release` sends a small "free"
notification back (MegaScale-Infer's buffer-free step), so a slot is never overwritten
before its consumer is done, with no barrier and no per-step set-up.

Sends are asynchronous: a write is posted from a per-slot staging buffer and its completion
is checked only before that staging slot is reused. The agent runs without NIXL's progress
thread (whose wake-ups cost ~16 ms per message here): whoever waits (a reader in recv, a
sender waiting for a slot) drives it, which keeps a message at tens of microseconds, and a
light keeper thread drives it every millisecond so that a peer's writes still complete while
this endpoint's owner is busy computing.
"""
from __future__ import annotations

import ctypes
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass, field

import torch

from tessera.transport.base import (Mailbox, Tag, TransportError, backoff_s, pack_header, tensor_bytes,
                                    unpack_header)

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")   # its INFO lines go to stdout (and into --json)
try:
    from nixl_cu12._api import nixl_agent, nixl_agent_config
except ImportError:   # other builds of the wheel name the package plainly
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        nixl_agent = nixl_agent_config = None

log = logging.getLogger("tessera.transport.nixl")
_DATA, _FREE = b"D", b"F"
_FREE_MSG = struct.Struct("<BB")      # direction, slot index
_META = struct.Struct("<QQII")        # agent metadata length, region address, slots, capacity


def available() -> bool:
    return nixl_agent is not None


@dataclass
class _Peer:
    address: int                      # base of our region in the peer's memory
    slots: int
    capacity: int
    staging: torch.Tensor             # registered local bytes we write from, one part per slot
    busy: set = field(default_factory=set)       # (direction, slot) the peer has not freed yet
    writes: dict = field(default_factory=dict)   # (direction, slot) -> write still in flight


class NixlTransport:
    def __init__(self, name: str, slots: int = 2, capacity_bytes: int = 8 << 20,
                 timeout_s: float = 30.0) -> None:
        if not available():
            raise TransportError("the nixl package is not installed (pip install nixl-cu12)")
        self.name, self.slots, self.capacity, self.timeout_s = name, slots, capacity_bytes, timeout_s
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self._lock = threading.Lock()  # the agent is created without internal locking
        self.mailbox = Mailbox(slots, poll=self._progress)
        self._regions: dict[str, torch.Tensor] = {}
        self._peers: dict[str, _Peer] = {}
        self._writing: set[str] = set()   # peers with writes in flight
        self.rejected = 0
        self._keeper = threading.Thread(target=self._keep, name=f"nixl-progress-{name}", daemon=True)
        self._keeper.start()

    def metadata_for(self, peer: str) -> bytes:
        """Our agent metadata and the address of the receive region reserved for `peer`."""
        with self._lock:
            region = self._regions.get(peer)
            if region is None:
                region = self._regions[peer] = self._registered(2 * self.slots * self.capacity)
                for direction in (0, 1):
                    for i in range(self.slots):
                        start = (direction * self.slots + i) * self.capacity
                        self.mailbox.attach(peer, direction, i, region[start:start + self.capacity])
            md = self.agent.get_agent_metadata()
        return _META.pack(len(md), region.data_ptr(), self.slots, self.capacity) + md

    def connect(self, peer: str, metadata: bytes) -> None:
        md_len, address, slots, capacity = _META.unpack_from(metadata)
        md = metadata[_META.size:_META.size + md_len]
        with self._lock:
            if peer in self._peers:   # a restarted peer: forget the old agent first
                self.agent.remove_remote_agent(peer)
            added = self.agent.add_remote_agent(md)
            if (added.decode() if isinstance(added, bytes) else added) != peer:
                raise TransportError(f"metadata for {peer} names agent {added!r}")
            old = self._peers.get(peer)
            size = 2 * slots * capacity
            staging = old.staging if old is not None and old.staging.numel() >= size else self._registered(size)
            self._peers[peer] = _Peer(address, slots, capacity, staging)

    def send(self, dst: str, tag: Tag, tensor: torch.Tensor) -> None:
        peer = self._peers.get(dst)
        if peer is None:
            raise TransportError(f"unknown endpoint {dst}")
        header = pack_header(tag, tensor)
        data = tensor_bytes(tensor)
        if data.numel() > peer.capacity:
            raise TransportError(f"{data.numel()} bytes exceed the {peer.capacity}-byte slots of {dst}")
        slot = (tag.direction, tag.micro_batch % peer.slots)
        self._wait(lambda: slot not in peer.busy and self._written(peer, slot), f"slot {slot} of {dst}")
        peer.busy.add(slot)
        if not data.numel():
            with self._lock:
                self.agent.send_notif(dst, _DATA + header)
            return
        offset = (slot[0] * peer.slots + slot[1]) * peer.capacity
        # memmove, not Tensor.copy_: a copy_ may wake torch's worker threads, which costs
        # milliseconds when the cores are busy polling.
        ctypes.memmove(peer.staging.data_ptr() + offset, data.data_ptr(), data.numel())
        with self._lock:
            local = self.agent.get_xfer_descs([(peer.staging.data_ptr() + offset, data.numel(), 0)], "DRAM")
            remote = self.agent.get_xfer_descs([(peer.address + offset, data.numel(), 0)], "DRAM")
            handle = self.agent.initialize_xfer("WRITE", local, remote, dst, _DATA + header)
            if self.agent.transfer(handle) == "ERR":
                handle.release()
                raise TransportError(f"write to {dst} failed")
            peer.writes[slot] = handle
            self._writing.add(dst)

    def _written(self, peer: _Peer, slot: tuple[int, int]) -> bool:
        """Whether the last write from this staging slot has completed (then it may be reused)."""
        with self._lock:
            handle = peer.writes.get(slot)
            if handle is None:
                return True
            state = self.agent.check_xfer_state(handle)
            if state == "PROC":
                return False
            handle.release()
            del peer.writes[slot]
            if not peer.writes:
                self._writing = {n for n in self._writing if self._peers[n].writes}
        if state != "DONE":
            raise TransportError("an earlier write failed: the peer is gone")
        return True

    def recv(self, src: str, tag: Tag, timeout_s: float = 30.0) -> torch.Tensor:
        return self.mailbox.get(src, tag, timeout_s)

    def take_any(self, src: str, direction: int, micro_batch: int, timeout_s: float = 30.0):
        return self.mailbox.take_any(src, direction, micro_batch, timeout_s)

    def release(self, src: str, tag: Tag) -> None:
        self.mailbox.release(src, tag)
        self._free(src, [(tag.direction, tag.micro_batch % self.slots)])

    def reset(self, src: str) -> None:
        self._free(src, self.mailbox.reset(src))

    def close(self) -> None:
        self.mailbox.close()
        if self._keeper is not threading.current_thread():
            self._keeper.join(timeout=1.0)

    def _keep(self) -> None:
        while not self.mailbox.closed:
            try:
                self._progress()
            except Exception as e:   # never let a transient agent error stop progress
                log.warning("progress: %s", e)
            time.sleep(0.001)

    def _free(self, src: str, slots: list[tuple[int, int]]) -> None:
        with self._lock:
            for direction, index in slots:
                try:
                    self.agent.send_notif(src, _FREE + _FREE_MSG.pack(direction, index))
                except Exception as e:   # a dead peer: its credits are reset when it reconnects
                    log.warning("cannot free slot %s of %s: %s", (direction, index), src, e)

    def _progress(self) -> bool:
        """Drive our writes in flight and deliver the notifications that arrived; True if
        there were any. (A posted write moves only while its sender checks on it.)"""
        if self._writing:
            for peer in [self._peers[name] for name in self._writing]:
                for slot in list(peer.writes):
                    self._written(peer, slot)
        with self._lock:
            notifs = self.agent.get_new_notifs()
        for src, messages in notifs.items():
            src = src.decode() if isinstance(src, bytes) else src
            for message in messages:
                try:
                    self._deliver(src, message)
                except (TransportError, struct.error) as e:
                    self.rejected += 1
                    log.warning("rejected a message from %s: %s", src, e)
        return bool(notifs)

    def _deliver(self, src: str, message: bytes) -> None:
        kind, body = message[:1], message[1:]
        if kind == _DATA:
            tag, dtype, shape, _ = unpack_header(body, src)
            self.mailbox.mark(src, tag, dtype, shape)
        elif kind == _FREE and src in self._peers:
            self._peers[src].busy.discard(_FREE_MSG.unpack(body))
        else:
            raise TransportError(f"unknown notification {message[:16]!r}")

    def _wait(self, ready, what: str) -> None:
        deadline, idle = time.monotonic() + self.timeout_s, 0
        while not ready():
            if time.monotonic() > deadline:
                raise TransportError(f"timed out after {self.timeout_s:g} s waiting for {what}")
            idle = 0 if self._progress() else idle + 1
            if idle:
                pause = backoff_s(idle)
                time.sleep(pause) if pause else os.sched_yield()

    def _registered(self, nbytes: int) -> torch.Tensor:
        with torch.inference_mode(False):
            buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.agent.register_memory([buffer])
        return buffer
