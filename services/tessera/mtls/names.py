"""Who is who on the internal network: each process holds a certificate from its deployment's
CA naming its role, and every internal link checks the other end's certificate before a byte
of a request moves (docs/security.md).

A certificate carries two kinds of names:
- a SPIFFE-style URI SAN, spiffe://<deployment>.tessera/<role>: who the holder is. A server
  reads it off the client's certificate and lets only the roles in CALLERS call its service.
- DNS SANs <service>.<deployment>.tessera, one per service the holder may serve (SERVES). A
  client dials any address but checks the server's certificate against the name of the service
  it wants, so a registry record pointing at another process of the deployment (an expert node
  posing as a worker) or anything outside it fails the TLS handshake; addresses are never what
  is verified.
"""
from __future__ import annotations

import re

ROLES = ("gateway", "worker", "target-worker", "draft-worker", "attention-node", "expert-node", "pipeline-shard")
# The gRPC services (and the M2N transport, "m2n") each role may serve.
SERVES = {
    "gateway": (),
    "worker": ("worker",),
    "target-worker": ("worker",),
    "attention-node": ("worker", "m2n"),
    "expert-node": ("expert-node", "m2n"),
    "pipeline-shard": ("worker", "pipeline-shard", "m2n"),   # stage 0 is the gateway's worker
    "draft-worker": ("draft-worker",),
}
# Which roles may call each service (grpc.health.v1 is open to any holder of the deployment's
# certificates: the probes use the pod's own).
CALLERS = {
    "tessera.rpc.v1.Worker": ("gateway",),
    "tessera.rpc.v1.ExpertNode": ("attention-node",),
    "tessera.rpc.v1.DraftWorker": ("worker", "target-worker"),
    "tessera.rpc.v1.PipelineShard": ("pipeline-shard",),
    "grpc.health.v1.Health": ROLES,
    "m2n": ("attention-node", "expert-node", "pipeline-shard"),
}
_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


def role_name(role: str) -> str:
    """A topology role (expert_node) as certificates name it (expert-node)."""
    name = role.replace("_", "-")
    if name not in ROLES:
        raise ValueError(f"unknown role {role!r} (known: {', '.join(ROLES)})")
    return name


def check_deployment(deployment: str) -> str:
    if not _LABEL.match(deployment):
        raise ValueError(f"deployment name {deployment!r}: lower-case letters, digits and '-', at most 63")
    return deployment


def spiffe_id(deployment: str, role: str) -> str:
    return f"spiffe://{check_deployment(deployment)}.tessera/{role_name(role)}"


def parse_spiffe_id(uri: str) -> tuple[str, str] | None:
    """(deployment, role) of one of our SPIFFE ids, else None."""
    m = re.fullmatch(r"spiffe://([a-z0-9-]+)\.tessera/([a-z-]+)", uri)
    return (m.group(1), m.group(2)) if m and m.group(2) in ROLES else None


def service_host(deployment: str, service: str) -> str:
    """The DNS name a server's certificate must carry to serve `service`."""
    return f"{service}.{check_deployment(deployment)}.tessera"


def service_of_method(method: str) -> str:
    """'/tessera.rpc.v1.Worker/Session' -> 'tessera.rpc.v1.Worker'."""
    return method.lstrip("/").split("/", 1)[0]
