"""`tessera probe TARGET`: a health check for containers (compose healthcheck, Kubernetes
exec probes), so images need no curl or grpc_health_probe. A gRPC port demands a certificate
of the deployment: the probe presents the container's own ($TESSERA_TLS_DIR) and checks the
server's names a service of that same role."""
from __future__ import annotations


def main(target: str, timeout_s: float = 5.0) -> int:
    """0 when TARGET is healthy: an http(s) URL answering 200, or a gRPC host:port whose
    grpc.health.v1 says SERVING; else 1."""
    if target.startswith(("http://", "https://")):
        import httpx
        try:
            return 0 if httpx.get(target, timeout=timeout_s).status_code == 200 else 1
        except httpx.HTTPError:
            return 1
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tessera import mtls
    from tessera.mtls.names import SERVES
    ident = mtls.identity()
    with mtls.channel(target, SERVES[ident.role][0] if ident and SERVES[ident.role] else "worker") as channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                 timeout=timeout_s).status
        except grpc.RpcError:
            return 1
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1
