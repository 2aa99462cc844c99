"""The attention node process (AFD): a worker whose engine runs attention, the KV cache, the
router and the sampler here and sends every layer's FFN to the expert nodes
(disagg/attention_node.py); it serves the same Worker service as a monolithic worker."""
from __future__ import annotations

import asyncio

from tessera.config import AfdConfig, EngineConfig


def main(config: EngineConfig, afd: AfdConfig, host: str, port: int, registration=None,
         metrics_port: int | None = None, shutdown_grace_s: float = 30.0) -> int:
    from tessera.disagg.attention_node import build_attention_engine
    from tessera.entrypoints.worker import serve
    from tessera.rpc.expert_client import GrpcExpertControl
    controls = [GrpcExpertControl(address) for address in afd.expert_nodes]
    asyncio.run(serve(config, host, port, build=lambda: build_attention_engine(config, afd, controls),
                      role="attention", registration=registration, metrics_port=metrics_port,
                      shutdown_grace_s=shutdown_grace_s))
    return 0
