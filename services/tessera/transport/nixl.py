"""M2N transport over NIXL (UCX): one-sided RDMA-style writes into the receiver's
pre-registered slots, each followed by a notification that carries the message header.

Agent metadata is exchanged only over the control plane's mutual-TLS gRPC calls (mtls/), and
notifications from an agent not announced there are refused. Every endpoint registers, per
peer, one region of 2 directions x `slots` slots x `capacity` bytes and hands the peer its agent metadata plus the region's address (`metadata_for`, sent
over the control channel). A sender writes micro-batch i into slot i % slots only after the
receiver has released that slot's previous message (MegaScale-Infer's buffer-free step), so a
slot is never overwritten before its consumer is done, with no barrier and no per-step set-up.

The hot path is kept to a memmove into a registered staging slot and one post:
- Transfer handles are made once per (slot, size bucket) and re-posted with a new
  notification each time (making one costs as much as the write itself here). Sizes are
  rounded up to a bucket (at most 1/8 more bytes) so that varying token counts reuse them.
- Frees ride on data: `release` only records the slot as owed to the peer, and the next
  message to that peer carries the owed slots in its notification. A standalone "free"
  notification goes out only when this endpoint starts waiting on that peer (then no message
  to it would come first) or after FLUSH_AFTER_S, so that nobody waits on a credit forever.

UCX's error handling mode is "none" by default (TESSERA_NIXL_ERROR_MODE, or error_mode=):
with "peer", UCX may use only transports that can report a failed peer, which on one host
rules out its shared-memory ones (cma, posix) and leaves loopback TCP, at about twice the
latency. A dead peer is still caught: every wait here has a deadline, the attention node's
FFN timeout fails the step, and the gRPC control channel notices the node is gone. Across
hosts UCX picks its network transports either way.

Sends are asynchronous: a write is posted from its staging slot and its completion is checked
only before that slot is reused. The agent runs without NIXL's progress thread (whose
wake-ups cost ~16 ms per message here): whoever waits (a reader in recv, a sender waiting for
a slot) drives it, which keeps a message at tens of microseconds, and a light keeper thread
drives it every millisecond so that a peer's writes still complete while this endpoint's
owner is busy computing.
"""
from __future__ import annotations

import ctypes
import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from tessera.transport.base import (ERROR, Mailbox, Tag, TransportError, backoff_s, pack_header,
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
_DATA, _FREE = 0x44, 0x46             # "D", "F"
_NOTE = struct.Struct("<BH")          # kind, bit mask of slots freed (bit = direction * slots + index)
_META = struct.Struct("<QQII")        # agent metadata length, region address, slots, capacity
MAX_SLOTS = 8                         # 2 directions x 8 slots fit the 16-bit free mask
HANDLES_PER_PEER = 128
FLUSH_AFTER_S = 0.001
ERROR_MODES = ("none", "peer")


def available() -> bool:
    return nixl_agent is not None


def size_bucket(nbytes: int, capacity: int) -> int:
    """nbytes rounded up to m * 2^k with 8 <= m < 16 (at most 1/8 more), at least 1 KiB, at
    most the slot's capacity: the length a cached transfer handle writes."""
    if nbytes <= 1024:
        return min(1024, capacity)
    step = 1 << max(0, nbytes.bit_length() - 4)
    return min(-(-nbytes // step) * step, capacity)


@dataclass
class _Peer:
    address: int                      # base of our region in the peer's memory
    slots: int
    capacity: int
    staging: torch.Tensor             # registered local bytes we write from, one part per slot
    busy: set = field(default_factory=set)       # (direction, slot) the peer has not freed yet
    writes: dict = field(default_factory=dict)   # (direction, slot) -> handle of a write in flight
    handles: OrderedDict = field(default_factory=OrderedDict)   # (slot, length) -> handle, LRU
    owed: int = 0                     # mask of the peer's slots we released and not yet told it
    owed_since: float = 0.0


class NixlTransport:
    def __init__(self, name: str, slots: int = 2, capacity_bytes: int = 8 << 20,
                 timeout_s: float = 30.0, error_mode: str | None = None) -> None:
        if not available():
            raise TransportError("the nixl package is not installed (pip install nixl-cu12)")
        if not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"nixl transport: slots must be within 1..{MAX_SLOTS}")
        error_mode = error_mode or os.environ.get("TESSERA_NIXL_ERROR_MODE", "none")
        if error_mode not in ERROR_MODES:
            raise ValueError(f"nixl transport: error mode {error_mode!r} (choose from {', '.join(ERROR_MODES)})")
        self.name, self.slots, self.capacity, self.timeout_s = name, slots, capacity_bytes, timeout_s
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
        self.agent.create_backend("UCX", {"ucx_error_handling_mode": error_mode})
        self._lock = threading.Lock()  # the agent is created without internal locking
        self.mailbox = Mailbox(slots, poll=self._progress, on_free=self._owe)
        self._regions: dict[str, torch.Tensor] = {}
        self._peers: dict[str, _Peer] = {}
        self._writing: set[str] = set()   # peers with writes in flight
        self._owing: set[str] = set()     # peers we owe frees
        self.rejected = 0
        self.flush_after_s = FLUSH_AFTER_S
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
        if not 1 <= slots <= MAX_SLOTS:
            raise TransportError(f"{peer} offers {slots} slots (at most {MAX_SLOTS})")
        with self._lock:
            old = self._peers.pop(peer, None)
            if old is not None:   # a restarted peer: its handles point at the old agent
                for handle in old.handles.values():
                    handle.release()
                self.agent.remove_remote_agent(peer)
            added = self.agent.add_remote_agent(md)
            if (added.decode() if isinstance(added, bytes) else added) != peer:
                raise TransportError(f"metadata for {peer} names agent {added!r}")
            size = 2 * slots * capacity
            staging = old.staging if old is not None and old.staging.numel() >= size else self._registered(size)
            self._peers[peer] = _Peer(address, slots, capacity, staging)
            self._writing.discard(peer)
            self._owing.discard(peer)

    def send(self, dst: str, tag: Tag, tensor: torch.Tensor, error: bool = False) -> None:
        peer = self._peers.get(dst)
        if peer is None:
            raise TransportError(f"unknown endpoint {dst}")
        header = pack_header(tag, tensor, ERROR if error else 0)
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > peer.capacity:
            raise TransportError(f"{nbytes} bytes exceed the {peer.capacity}-byte slots of {dst}")
        slot = (tag.direction, tag.micro_batch % peer.slots)
        if slot in peer.busy or slot in peer.writes:
            self._flush(dst)   # the peer may be waiting on our credits before it frees this slot
            self._wait(lambda: slot not in peer.busy and self._written(peer, slot), f"slot {slot} of {dst}")
        peer.busy.add(slot)
        offset = (slot[0] * peer.slots + slot[1]) * peer.capacity
        if nbytes:
            # memmove, not Tensor.copy_: a copy_ may wake torch's worker threads, which costs
            # milliseconds when the cores are busy polling.
            ctypes.memmove(peer.staging.data_ptr() + offset, tensor.data_ptr(), nbytes)
        with self._lock:
            note = _NOTE.pack(_DATA, peer.owed) + header
            peer.owed = 0
            if not nbytes:
                self.agent.send_notif(dst, note)
                return
            handle = self._handle(dst, peer, slot, offset, size_bucket(nbytes, peer.capacity))
            # Check once at once: UCX sends the notification only when someone looks at the
            # write after it is done, and the reader waits on that notification.
            if self.agent.transfer(handle, note) == "ERR" or (state := self.agent.check_xfer_state(handle)) == "ERR":
                raise TransportError(f"write to {dst} failed")
            if state == "PROC":
                peer.writes[slot] = handle
                self._writing.add(dst)

    def _handle(self, dst: str, peer: _Peer, slot: tuple[int, int], offset: int, length: int):
        """A transfer handle writing `length` bytes of the staging slot into the peer's slot,
        made once and re-posted (caller holds the lock)."""
        key = (slot, length)
        handle = peer.handles.get(key)
        if handle is not None:
            peer.handles.move_to_end(key)
            return handle
        local = self.agent.get_xfer_descs([(peer.staging.data_ptr() + offset, length, 0)], "DRAM")
        remote = self.agent.get_xfer_descs([(peer.address + offset, length, 0)], "DRAM")
        handle = peer.handles[key] = self.agent.initialize_xfer("WRITE", local, remote, dst)
        if len(peer.handles) > HANDLES_PER_PEER:
            in_flight = {id(h) for h in peer.writes.values()}
            for old_key, old in list(peer.handles.items()):
                if id(old) not in in_flight:
                    del peer.handles[old_key]
                    old.release()
                    break
        return handle

    def _written(self, peer: _Peer, slot: tuple[int, int]) -> bool:
        """Whether the last write from this staging slot has completed (then it may be reused)."""
        with self._lock:
            handle = peer.writes.get(slot)
            if handle is None:
                return True
            state = self.agent.check_xfer_state(handle)
            if state == "PROC":
                return False
            del peer.writes[slot]
            if not peer.writes:
                self._writing = {n for n in self._writing if self._peers[n].writes}
        if state != "DONE":
            raise TransportError("an earlier write failed: the peer is gone")
        return True

    def recv(self, src: str, tag: Tag, timeout_s: float = 30.0) -> torch.Tensor:
        self._flush(src)
        return self.mailbox.get(src, tag, timeout_s)

    def take_any(self, src: str, direction: int, micro_batch: int, timeout_s: float = 30.0):
        self._flush(src)
        return self.mailbox.take_any(src, direction, micro_batch, timeout_s)

    def release(self, src: str, tag: Tag) -> None:
        self.mailbox.release(src, tag)   # the freed slot is owed to src (on_free=_owe)

    def reset(self, src: str) -> None:
        self.mailbox.reset(src)
        self._flush(src)

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

    def _owe(self, src: str, slots: list[tuple[int, int]]) -> None:
        peer = self._peers.get(src)
        if peer is None or not slots:
            return
        with self._lock:
            if not peer.owed:
                peer.owed_since = time.monotonic()
            for direction, index in slots:
                peer.owed |= 1 << (direction * self.slots + index)
            self._owing.add(src)

    def _flush(self, src: str) -> None:
        """Send the frees owed to `src` now, as a notification of their own."""
        if src not in self._owing:
            return
        with self._lock:
            self._owing.discard(src)
            peer = self._peers.get(src)
            if peer is None or not peer.owed:
                return
            owed, peer.owed = peer.owed, 0
            try:
                self.agent.send_notif(src, _NOTE.pack(_FREE, owed))
            except Exception as e:   # a dead peer: its credits are reset when it reconnects
                log.warning("cannot free slots %#x of %s: %s", owed, src, e)

    def _progress(self) -> bool:
        """Drive our writes in flight, deliver the notifications that arrived, and flush frees
        owed for too long; True if anything arrived. (A posted write moves only while its
        sender checks on it.)"""
        if self._writing:
            for peer in [self._peers[name] for name in list(self._writing)]:
                for slot in list(peer.writes):
                    self._written(peer, slot)
        if self._owing:
            now = time.monotonic()
            for src in [s for s in list(self._owing) if now - self._peers[s].owed_since > self.flush_after_s]:
                self._flush(src)
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
        peer = self._peers.get(src)
        if peer is None:    # only agents announced over the (mutual TLS) control plane are read
            raise TransportError(f"notification from unannounced agent {src!r}")
        kind, freed = _NOTE.unpack_from(message)
        if kind not in (_DATA, _FREE):
            raise TransportError(f"unknown notification {message[:16]!r}")
        if freed:
            for bit in range(2 * peer.slots):
                if freed >> bit & 1:
                    peer.busy.discard(divmod(bit, peer.slots))
        if kind == _DATA:
            tag, dtype, shape, _, flags = unpack_header(message[_NOTE.size:], src)
            self.mailbox.mark(src, tag, dtype, shape, flags)

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
