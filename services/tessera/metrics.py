"""Prometheus metrics of the gateway, named tessera_* with a model_name label (the same
shapes as vllm: / sglang: so existing dashboards carry over). Each app owns its registry."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tessera.worker_api import GenerateChunk, WorkerInfo

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class WorkerCollector:
    """A worker's own Prometheus metrics (`--metrics-port`), read from the engine at scrape
    time: queue depth, running batch, KV usage, plus the count of requests it has served."""

    def __init__(self, engine, role: str) -> None:
        self.engine, self.role = engine, role

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily
        info = self.engine.info()
        labels = ["model_name", "role"]
        values = [info.model_id, self.role]
        used = 1 - info.num_free_kv_blocks / info.num_kv_blocks if info.num_kv_blocks else 0.0
        for name, doc, value in (("tessera_worker_num_requests_running", "Requests in the batch", info.num_running),
                                 ("tessera_worker_num_requests_waiting", "Queue depth", info.num_waiting),
                                 ("tessera_worker_kv_cache_usage_ratio", "Fraction of KV blocks in use", used),
                                 ("tessera_worker_kv_cache_free_blocks", "Free KV blocks", info.num_free_kv_blocks)):
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            yield family


def serve_worker_metrics(engine, role: str, port: int, host: str = "127.0.0.1") -> None:
    """Prometheus text on http://host:port/metrics (a thread of prometheus_client), on the
    worker's configured host, never every interface by default."""
    from prometheus_client import start_http_server
    registry = CollectorRegistry()
    registry.register(WorkerCollector(engine, role))
    start_http_server(port, addr=host, registry=registry)


class GatewayMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.requests = Counter("tessera_requests", "Finished HTTP requests by status code",
                                ["model_name", "status"], registry=r)
        self._ttft = Histogram("tessera_time_to_first_token_seconds", "Time to first token",
                               labels, buckets=_LATENCY, registry=r)
        self._itl = Histogram("tessera_inter_token_latency_seconds", "Time between streamed chunks",
                              labels, buckets=_LATENCY, registry=r)
        self._e2e = Histogram("tessera_e2e_request_latency_seconds", "End-to-end latency per choice",
                              labels, buckets=_LATENCY, registry=r)
        self._gen = Counter("tessera_generation_tokens", "Generated tokens", labels, registry=r)
        self._running = Gauge("tessera_num_requests_running", "Requests in the engine's batch",
                              labels, registry=r)
        self._waiting = Gauge("tessera_num_requests_waiting", "Requests queued in the engine",
                              labels, registry=r)
        self._kv = Gauge("tessera_kv_cache_usage_ratio", "Fraction of KV blocks in use", labels, registry=r)
        self._kv_free = Gauge("tessera_kv_cache_free_blocks", "Free KV blocks", labels, registry=r)
        self._workers = Gauge("tessera_gateway_workers", "Workers the gateway routes to (registry members)",
                              labels, registry=r)
        self._failovers = Counter("tessera_gateway_failovers", "Requests resumed on another worker",
                                  labels, registry=r)
        self._failovers_seen = 0
        self._routed = Counter("tessera_gateway_routed_requests", "Requests (attempts) routed to each worker",
                               ["model_name", "worker"], registry=r)
        self._routed_seen: dict[str, int] = {}
        self._inflight = Gauge("tessera_gateway_requests_inflight", "Requests admitted and not finished",
                               labels, registry=r)
        self._rejected = Gauge("tessera_gateway_rejected_requests", "Requests refused at admission, by status",
                               ["model_name", "status"], registry=r)
        self.model_name = model_name
        self.ttft, self.itl, self.e2e = (h.labels(model_name) for h in (self._ttft, self._itl, self._e2e))

    def observe_token(self, chunk: GenerateChunk, since_start: float, since_last: float, first: bool) -> None:
        if not chunk.token_ids:
            return
        (self.ttft.observe(since_start) if first else self.itl.observe(since_last))
        self._gen.labels(self.model_name).inc(len(chunk.token_ids))

    def count(self, status: int) -> None:
        self.requests.labels(self.model_name, str(status)).inc()

    def render(self, info: WorkerInfo | None, pool=None, admission=None) -> bytes:
        if pool is not None:   # a WorkerPool: membership, routing decisions and failovers so far
            self._workers.labels(self.model_name).set(len(pool.members))
            self._failovers.labels(self.model_name).inc(pool.failovers - self._failovers_seen)
            self._failovers_seen = pool.failovers
            for worker, n in list(pool.routed.items()):
                self._routed.labels(self.model_name, worker).inc(n - self._routed_seen.get(worker, 0))
                self._routed_seen[worker] = n
        if admission is not None:
            self._inflight.labels(self.model_name).set(admission.inflight)
            for status, n in admission.rejected.items():
                self._rejected.labels(self.model_name, status).set(n)
        if info is not None:
            m = self.model_name
            self._running.labels(m).set(info.num_running)
            self._waiting.labels(m).set(info.num_waiting)
            self._kv_free.labels(m).set(info.num_free_kv_blocks)
            used = 1 - info.num_free_kv_blocks / info.num_kv_blocks if info.num_kv_blocks else 0.0
            self._kv.labels(m).set(used)
        return generate_latest(self.registry)
