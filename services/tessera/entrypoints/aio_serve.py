"""The serving loop every asyncio gRPC role without an engine shares (draft worker, pipeline
stage): mutual TLS and the callers' roles checked (mtls/), grpc.health.v1 SERVING for "" and the role's service,
background tasks (registry heartbeats), and on SIGTERM / SIGINT: stop the tasks (leave the
registry), say NOT_SERVING, give calls in flight shutdown_grace_s."""
from __future__ import annotations

import asyncio
import signal
from typing import Callable, Coroutine

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tessera import mtls
from tessera.gc_heap import freeze_startup_heap


async def serve_until_signal(add_servicer: Callable[[grpc.aio.Server], None], service: str, host: str, port: int,
                             background: list[Coroutine], ready: Callable[[int], None],
                             shutdown_grace_s: float = 30.0) -> None:
    """ready(bound port) runs once the server accepts calls."""
    server = grpc.aio.server(options=mtls.SERVER_OPTIONS, interceptors=[mtls.AioServerInterceptor()])
    add_servicer(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", service):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    bound = mtls.add_port(server, host, port)
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stopping.set)
    await server.start()
    tasks = [asyncio.create_task(c) for c in background]
    freeze_startup_heap()
    ready(bound)
    await stopping.wait()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    health_servicer.enter_graceful_shutdown()
    await server.stop(shutdown_grace_s)
