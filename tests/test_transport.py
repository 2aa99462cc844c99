"""The M2N transport: every backend delivers tagged tensors M -> N and back, checks tags,
never overwrites an unreleased slot, and survives malformed input."""
from __future__ import annotations

import contextlib
import socket
import struct
import threading

import pytest
import torch

from tessera.transport.base import COMBINE, DISPATCH, PeerError, Tag, TransportError, combine, dispatch, send_error
from tessera.transport.local import Fabric
from tessera.transport import link, nixl
from tessera.transport.nixl import NixlTransport
from tessera.transport.tcp import TcpTransport


def local_endpoints(names, slots=2):
    fabric = Fabric(slots)
    return {n: fabric.endpoint(n) for n in names}


def linked(make_one):
    def build(names, slots=2):
        eps = {n: make_one(n, slots) for n in names}
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                link(eps[a], eps[b])
        return eps
    return build


BACKENDS = {"local": local_endpoints, "tcp": linked(lambda n, s: TcpTransport(n, slots=s)),
            "nixl": linked(lambda n, s: NixlTransport(n, slots=s, capacity_bytes=1 << 20, timeout_s=10))}
NO_NIXL = pytest.mark.skipif(not nixl.available(), reason="the nixl package does not import")


@pytest.fixture(params=["local", "tcp", pytest.param("nixl", marks=NO_NIXL)])
def make(request):
    made = []

    def build(names, slots=2):
        eps = BACKENDS[request.param](names, slots)
        made.extend(eps.values())
        return eps

    yield build
    for ep in made:
        ep.close()


def test_m2n_dispatch_and_combine_round_trip(make):
    attn, experts = ["a0", "a1"], ["e0", "e1", "e2"]
    eps = make(attn + experts)
    sent = {}
    for mb in range(3):
        for a in attn:
            parts = {e: torch.randn(4 + mb, 8) if e != "e2" else torch.arange(mb + 1) for e in experts}
            sent[a, mb] = parts
            dispatch(eps[a], Tag(1, mb, 0, DISPATCH), parts)
        for e in experts:
            got = combine(eps[e], Tag(1, mb, 0, DISPATCH), attn)
            for a in attn:
                assert torch.equal(got[a], sent[a, mb][e])
            for a in attn:   # the reply goes back N -> M
                eps[e].send(a, Tag(1, mb, 0, COMBINE), got[a].to(torch.bfloat16) if got[a].is_floating_point() else got[a])
        for a in attn:
            back = combine(eps[a], Tag(1, mb, 0, COMBINE), experts)
            assert back["e2"].dtype == torch.int64 and back["e0"].dtype == torch.bfloat16
            assert torch.equal(back["e1"], sent[a, mb]["e1"].to(torch.bfloat16))


def test_error_flag_arrives_as_an_error_and_frees_the_slot(make):
    """An error sent under a tag (the header's ERROR flag) makes the receiver's recv of that
    tag raise PeerError with the reason; its slot is free again (one slot: the next message
    could not land otherwise), and data messages still arrive as data."""
    eps = make(["a", "e"], slots=1)
    eps["a"].send("e", Tag(3, 0, 1, DISPATCH), torch.ones(4))
    assert torch.equal(eps["e"].recv("a", Tag(3, 0, 1, DISPATCH), timeout_s=5), torch.ones(4))
    eps["e"].release("a", Tag(3, 0, 1, DISPATCH))
    send_error(eps["e"], "a", Tag(3, 0, 1, COMBINE), "layer 1: message of shape (4,)")
    with pytest.raises(PeerError, match=r"layer 1: message of shape \(4,\)"):
        eps["a"].recv("e", Tag(3, 0, 1, COMBINE), timeout_s=5)
    eps["e"].send("a", Tag(4, 0, 0, COMBINE), torch.arange(3))
    assert torch.equal(eps["a"].recv("e", Tag(4, 0, 0, COMBINE), timeout_s=5), torch.arange(3))


def test_wrong_tag_is_an_error_not_data(make):
    eps = make(["a", "e"])
    eps["a"].send("e", Tag(5, 0, 3, DISPATCH), torch.ones(2))
    with pytest.raises(TransportError, match="expected"):
        eps["e"].recv("a", Tag(5, 0, 4, DISPATCH), timeout_s=5)
    assert torch.equal(eps["e"].recv("a", Tag(5, 0, 3, DISPATCH), timeout_s=5), torch.ones(2))
    with pytest.raises(TransportError):
        eps["e"].recv("a", Tag(5, 1, 3, DISPATCH), timeout_s=0.2)


def test_busy_slot_is_never_overwritten(make):
    eps = make(["a", "e"], slots=1)
    first, second = Tag(0, 0, 0, DISPATCH), Tag(0, 1, 0, DISPATCH)
    eps["a"].send("e", first, torch.full((3,), 1.0))
    done = threading.Event()
    threading.Thread(target=lambda: (eps["a"].send("e", second, torch.full((3,), 2.0)), done.set()),
                     daemon=True).start()
    view = eps["e"].recv("a", first, timeout_s=5)
    done.wait(0.3)   # tcp: the send returns once the bytes are in flight; local: it blocks
    assert torch.equal(view, torch.full((3,), 1.0))
    eps["e"].release("a", first)
    assert torch.equal(eps["e"].recv("a", second, timeout_s=5), torch.full((3,), 2.0))


def test_tcp_malformed_frame_is_rejected_and_serving_continues():
    e, a = TcpTransport("e"), TcpTransport("a")
    link(a, e)
    e.add_peer("bad", ("127.0.0.1", 1))   # announced, so its first frame is read (and refused)
    try:
        with socket.create_connection(e.address) as raw:
            raw.sendall(struct.pack("<B", 3) + b"bad" + struct.pack("<qiiBBBxQ", 0, 0, 0, 0, 99, 1, 4))
            with contextlib.suppress(ConnectionResetError):
                assert raw.recv(1) == b""  # the receiver closes this link
        a.send("e", Tag(0, 0, 0, DISPATCH), torch.arange(5))
        assert torch.equal(e.recv("a", Tag(0, 0, 0, DISPATCH), timeout_s=5), torch.arange(5))
        assert e.rejected == 1
    finally:
        a.close()
        e.close()


def test_nixl_size_buckets_round_up_by_at_most_an_eighth():
    for n in [1, 1000, 1025, 65536, 65537, 100_000, 3 << 20]:
        b = nixl.size_bucket(n, 16 << 20)
        assert n <= b <= max(1024, n + n // 8)
    assert nixl.size_bucket(100, 512) == 512 and nixl.size_bucket(5 << 20, 4 << 20) == 4 << 20


@NO_NIXL
def test_nixl_frees_ride_on_data_and_are_flushed_when_waiting():
    """A released slot's credit travels in the next message to its sender (no notification of
    its own); when no message comes first (the receiver waits on that sender), it is sent
    alone, so a sender never waits on a credit forever. Handles are reused, not remade."""
    eps = linked(lambda n, s: NixlTransport(n, slots=s, capacity_bytes=1 << 16, timeout_s=10))(["a", "e"], 1)
    a, e = eps["a"], eps["e"]
    e.flush_after_s = 60   # only the piggyback and the flush-on-wait paths, not the timer
    standalone = []
    real_notif = e.agent.send_notif
    e.agent.send_notif = lambda dst, msg: (standalone.append(msg), real_notif(dst, msg))
    try:
        for step in range(4):   # one slot: each send needs the previous message released
            a.send("e", Tag(step, 0, 0, DISPATCH), torch.full((64,), float(step)))
            x = e.recv("a", Tag(step, 0, 0, DISPATCH)).clone()
            e.release("a", Tag(step, 0, 0, DISPATCH))
            e.send("a", Tag(step, 0, 0, COMBINE), x + 1)   # carries the free
            assert torch.equal(a.recv("e", Tag(step, 0, 0, COMBINE)), torch.full((64,), step + 1.0))
            a.release("e", Tag(step, 0, 0, COMBINE))
        assert standalone == []
        assert len(a._peers["e"].handles) == 1 and len(e._peers["a"].handles) == 1
        # Now e releases and then waits on a before sending anything: the credit goes alone.
        a.send("e", Tag(9, 0, 0, DISPATCH), torch.ones(64))
        e.recv("a", Tag(9, 0, 0, DISPATCH))
        e.release("a", Tag(9, 0, 0, DISPATCH))
        threading.Timer(0.2, lambda: a.send("e", Tag(10, 0, 0, DISPATCH), torch.ones(64))).start()
        assert torch.equal(e.recv("a", Tag(10, 0, 0, DISPATCH), timeout_s=5), torch.ones(64))
        assert len(standalone) == 1
    finally:
        a.close()
        e.close()


@NO_NIXL
@pytest.mark.parametrize("mode", nixl.ERROR_MODES)
def test_nixl_error_modes_both_deliver(mode):
    """"none" (the default: UCX may use shared memory on one host) and "peer" (UCX's peer-
    failure reporting, loopback TCP here) move the same bytes; anything else is refused."""
    eps = linked(lambda n, s: NixlTransport(n, slots=s, capacity_bytes=1 << 20, error_mode=mode))(["a", "e"])
    try:
        x = torch.randn(300, 100)
        eps["a"].send("e", Tag(0, 0, 0, DISPATCH), x)
        assert torch.equal(eps["e"].recv("a", Tag(0, 0, 0, DISPATCH)), x)
    finally:
        for ep in eps.values():
            ep.close()
    with pytest.raises(ValueError, match="error mode"):
        NixlTransport("bad", error_mode="abort")


@NO_NIXL
def test_nixl_refuses_notifications_from_an_agent_the_control_plane_never_announced():
    """A stranger that got hold of e's metadata (only ever sent over mutual-TLS control calls)
    writes and notifies: e delivers nothing from it, and the announced peer still gets through."""
    make = lambda n: NixlTransport(n, slots=1, capacity_bytes=1 << 16, timeout_s=10)  # noqa: E731
    e, a, stranger = make("e"), make("a"), make("stranger")
    try:
        link(a, e)
        stranger.connect("e", e.metadata_for("a"))
        stranger.send("e", Tag(0, 0, 0, DISPATCH), torch.ones(16))
        with pytest.raises(TransportError):
            e.recv("stranger", Tag(0, 0, 0, DISPATCH), timeout_s=1)
        assert e.rejected >= 1
        a.send("e", Tag(1, 0, 0, DISPATCH), torch.full((16,), 2.0))
        assert torch.equal(e.recv("a", Tag(1, 0, 0, DISPATCH), timeout_s=5), torch.full((16,), 2.0))
    finally:
        for t in (stranger, a, e):
            t.close()
