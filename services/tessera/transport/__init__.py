"""M2N transport for attention-FFN disaggregation: tagged tensor messages from M senders to N
receivers (dispatch) and back (combine). base.py has the interface and the slot mailbox,
local.py the in-process twin, tcp.py sockets between processes, nixl.py one-sided writes
over NIXL/UCX into pre-registered slots."""
from __future__ import annotations

BACKENDS = ("auto", "nixl", "tcp")


def resolve_backend(backend: str) -> str:
    """'auto' is nixl where the package imports, else tcp."""
    from tessera.transport import nixl
    if backend == "auto":
        return "nixl" if nixl.available() else "tcp"
    if backend not in BACKENDS:
        raise ValueError(f"unknown transport {backend!r} (choose from {', '.join(BACKENDS)})")
    return backend


def make_transport(backend: str, name: str, slots: int = 2, host: str = "127.0.0.1",
                   capacity_bytes: int = 8 << 20, timeout_s: float = 30.0, advertise: str | None = None):
    """A process-to-process endpoint named `name` (the in-process twin is local.Fabric).
    advertise: the host peers dial (containers, pods); tcp then listens on every interface.
    NIXL needs neither: its metadata carries UCX's own worker addresses."""
    backend = resolve_backend(backend)
    if backend == "nixl":
        from tessera.transport.nixl import NixlTransport
        return NixlTransport(name, slots=slots, capacity_bytes=capacity_bytes, timeout_s=timeout_s)
    from tessera.transport.tcp import TcpTransport
    if advertise:
        return TcpTransport(name, host="0.0.0.0", slots=slots, advertise=advertise, capacity_bytes=capacity_bytes)
    return TcpTransport(name, host=host, slots=slots, capacity_bytes=capacity_bytes)


def link(a, b) -> None:
    """Connect two endpoints both ways by exchanging their metadata (tests and benchmarks do
    it directly; the nodes of a deployment do it over the gRPC control channel)."""
    a.connect(b.name, b.metadata_for(a.name))
    b.connect(a.name, a.metadata_for(b.name))
