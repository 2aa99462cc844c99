"""A later pipeline stage's Prometheus metrics (`tessera pipeline-shard --metrics-port`), named
tessera_pipeline_shard_* and read from the stage at scrape time. Stage 0 is a worker and has
the worker's metrics."""
from __future__ import annotations

from prometheus_client import CollectorRegistry


class PipelineShardCollector:
    def __init__(self, shard) -> None:
        self.shard = shard

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        info = self.shard.info()
        labels, values = ["model_name", "stage"], [info.model_id, str(info.stage_index)]
        for name, doc, value in (
                ("micro_batches", "Micro-batches run through this stage's layers", info.micro_batches),
                ("tokens", "Tokens run through this stage's layers", info.tokens),
                ("rejected_steps", "Steps dropped here (a malformed message or a peer's error)", info.rejected),
                ("compute_seconds", "Time spent in this stage's layers", info.compute_s)):
            family = CounterMetricFamily(f"tessera_pipeline_shard_{name}", doc, labels=labels)
            family.add_metric(values, value)
            yield family
        for name, doc, value in (
                ("weight_bytes", "Bytes of the weights this stage holds", info.weight_bytes),
                ("kv_cache_bytes", "Bytes of this stage's KV cache", info.kv_bytes),
                ("memory_budget_bytes", "This stage's --memory-gib (0: none)", info.memory_budget_bytes),
                ("linked", "1 while the stage is linked into a pipeline", int(bool(info.pipeline)))):
            family = GaugeMetricFamily(f"tessera_pipeline_shard_{name}", doc, labels=labels)
            family.add_metric(values, value)
            yield family


def serve_shard_metrics(shard, port: int, host: str = "127.0.0.1") -> None:
    """Prometheus text on http://host:port/metrics (a thread of prometheus_client)."""
    from prometheus_client import start_http_server
    registry = CollectorRegistry()
    registry.register(PipelineShardCollector(shard))
    start_http_server(port, addr=host, registry=registry)
