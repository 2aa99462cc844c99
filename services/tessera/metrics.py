"""Prometheus metrics of the gateway, named tessera_* with a model_name label (the same
shapes as vllm: / sglang: so existing dashboards carry over), and of the worker and draft
worker processes (`--metrics-port`). Each app owns its registry. With tracing on, the latency
histograms carry the observing request's trace id as an exemplar, which only the OpenMetrics
exposition shows (a scraper asks for it with its Accept header, as Prometheus does)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics

from tessera import tracing
from tessera.worker_api import GenerateChunk, WorkerInfo

_EMITTED = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 32)
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_REQUEST_TIME = _LATENCY + (120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)   # a CPU decode can take minutes (vLLM's top)


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
        yield from _counters("tessera_worker_spec_decode", labels, values, (
            ("num_drafts", "Draft trees verified", info.spec_verify_rounds),
            ("num_draft_tokens", "Draft tokens verified", info.spec_draft_tokens),
            ("num_accepted_tokens", "Draft tokens the target accepted", info.spec_accepted_tokens),
            ("num_emitted_tokens", "Tokens the verify rounds emitted", info.spec_emitted_tokens)))
        rounds = info.spec_verify_rounds
        length = GaugeMetricFamily("tessera_worker_spec_decode_acceptance_length",
                                   "Tokens emitted per verify round since start (accepted + the target's own)",
                                   labels=labels)
        length.add_metric(values, info.spec_emitted_tokens / rounds if rounds else 0.0)
        yield length
        yield from _counters("tessera_worker_prefix_cache", labels, values, (
            ("queries", "Tokens looked up in the prefix cache at admission", info.prefix_cache_queries),
            ("hits", "Tokens the prefix cache had (hit rate = hits / queries)", info.prefix_cache_hits)))
        yield from _counters("tessera_worker_step_replay", labels, values, (
            ("checks", "Replayed steps checked again against the eager step (--replay-check-every)",
             info.replay_checks),
            ("mismatches", "Re-checked replays that differed (their graph dropped; a bug to report)",
             info.replay_mismatches)))
        yield from _counters("tessera_worker_stage", labels, values, (
            ("compute_seconds", "A pipeline's first stage: time in its own layers (0 on other workers; later "
                                "stages: tessera_pipeline_shard_compute_seconds)", info.stage_compute_s),))


def _counters(prefix: str, labels: list[str], values: list[str], rows):
    from prometheus_client.core import CounterMetricFamily
    for name, doc, value in rows:
        family = CounterMetricFamily(f"{prefix}_{name}", doc, labels=labels)
        family.add_metric(values, value)
        yield family


class DraftCollector:
    """A draft worker's metrics (`--metrics-port`): rounds answered and refused (by reason:
    malformed, out_of_sync), requests holding draft state, and the drafting work itself."""

    def __init__(self, rounds, stats=None) -> None:
        self.rounds, self.stats = rounds, stats

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        info = self.rounds.info()
        requests = GaugeMetricFamily("tessera_draft_worker_requests", "Requests holding draft state",
                                     labels=["model_name"])
        requests.add_metric([info.model_id], info.requests)
        yield requests
        refused = CounterMetricFamily("tessera_draft_worker_refused_rounds", "Rounds refused, never applied",
                                      labels=["model_name", "reason"])
        for reason in ("malformed", "out_of_sync"):
            refused.add_metric([info.model_id, reason], self.rounds.refused[reason])
        yield refused
        s = self.stats
        yield from _counters("tessera_draft_worker", ["model_name"], [info.model_id], (
            ("rounds", "Rounds answered", info.rounds),
            *((("tree_hits", "Rounds whose new root was in the tree", s.hits),
               ("expansions", "Draft forwards that grew a tree", s.expansions),
               ("topup_expansions", "Expansions a round waited for (its tree was short)", s.topups),
               ("wasted_nodes", "Expanded nodes dropped by re-roots", s.wasted_nodes),
               ("draft_seconds", "Time spent drafting", s.draft_seconds)) if s is not None else ())))


def serve_draft_metrics(rounds, port: int, host: str = "127.0.0.1") -> None:
    """A draft worker's Prometheus text on http://host:port/metrics."""
    from prometheus_client import start_http_server
    registry = CollectorRegistry()
    registry.register(DraftCollector(rounds, rounds.stats))
    start_http_server(port, addr=host, registry=registry)


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
        self._drafts = Counter("tessera_spec_decode_num_drafts", "Speculative verify rounds", labels, registry=r)
        self._accepted = Counter("tessera_spec_decode_num_accepted_tokens", "Draft tokens the target accepted",
                                 labels, registry=r)
        self._rejected_drafts = Counter("tessera_spec_decode_num_rejected_tokens",
                                        "Draft tokens verified and rejected", labels, registry=r)
        self._acceptance = Histogram("tessera_spec_decode_acceptance_length",
                                     "Tokens emitted per verify round (accepted + the target's own)", labels,
                                     buckets=_EMITTED, registry=r)
        self._rejected = Gauge("tessera_gateway_rejected_requests", "Requests refused at admission, by status",
                               ["model_name", "status"], registry=r)
        self._prefix_queries = Counter("tessera_prefix_cache_queries", "Prompt tokens of finished requests",
                                       labels, registry=r)
        self._prefix_hits = Counter("tessera_prefix_cache_hits", "Of those, tokens the workers' prefix caches "
                                    "served (usage.prompt_tokens_details.cached_tokens; hit rate = hits / queries)",
                                    labels, registry=r)
        # vLLM's request_{queue,prefill,decode,inference}_time_seconds, as the worker measured them
        self._phases = {phase: Histogram(f"tessera_request_{phase}_time_seconds", help_, labels,
                                         buckets=_REQUEST_TIME, registry=r)
                        for phase, help_ in (("queue", "Worker tokenized -> first scheduled"),
                                             ("prefill", "First scheduled -> first output token"),
                                             ("decode", "First output token -> finished"),
                                             ("inference", "First scheduled -> finished"))}
        self.model_name = model_name
        self.ttft, self.itl, self.e2e = (h.labels(model_name) for h in (self._ttft, self._itl, self._e2e))

    def observe_token(self, chunk: GenerateChunk, since_start: float, since_last: float, first: bool) -> None:
        if not chunk.token_ids:
            return
        exemplar = _exemplar()
        (self.ttft.observe(since_start, exemplar) if first else self.itl.observe(since_last, exemplar))
        self._gen.labels(self.model_name).inc(len(chunk.token_ids))

    def observe_e2e(self, seconds: float) -> None:
        self.e2e.observe(seconds, _exemplar())

    def observe_spec(self, chunk: GenerateChunk, seen: tuple[int, int]) -> tuple[int, int]:
        """seen: the choice's (accepted, rejected) draft tokens before this chunk. A chunk that
        moves them is one verify round (a worker sends one chunk per engine step), and its
        tokens are what the round emitted: the acceptance length as engine.SpecStats counts it."""
        accepted, rejected = chunk.accepted_tokens - seen[0], chunk.rejected_tokens - seen[1]
        if accepted > 0 or rejected > 0:
            m = self.model_name
            self._drafts.labels(m).inc()
            self._accepted.labels(m).inc(max(accepted, 0))
            self._rejected_drafts.labels(m).inc(max(rejected, 0))
            self._acceptance.labels(m).observe(len(chunk.token_ids))
        return chunk.accepted_tokens, chunk.rejected_tokens

    def observe_finish(self, chunk: GenerateChunk) -> None:
        """A choice's last chunk: its prompt tokens, those the prefix cache served, and where
        its time went in the worker (when the worker says)."""
        if not chunk.finish_reason:
            return
        m = self.model_name
        self._prefix_queries.labels(m).inc(chunk.prompt_tokens)
        self._prefix_hits.labels(m).inc(chunk.cached_tokens)
        t = chunk.timings
        if t is not None:
            for phase, seconds in (("queue", t.queue_time_s), ("prefill", t.prefill_time_s),
                                   ("decode", t.decode_time_s), ("inference", t.prefill_time_s + t.decode_time_s)):
                self._phases[phase].labels(m).observe(seconds)

    def count(self, status: int) -> None:
        self.requests.labels(self.model_name, str(status)).inc()

    def render(self, info: WorkerInfo | None, pool=None, admission=None, accept: str = "") -> tuple[bytes, str]:
        """(body, content type): OpenMetrics, exemplars included, when `accept` (the scraper's
        Accept header) asks for it, else the classic text format."""
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
        if "application/openmetrics-text" in accept:
            return openmetrics.generate_latest(self.registry), openmetrics.CONTENT_TYPE_LATEST
        return generate_latest(self.registry), "text/plain; version=0.0.4; charset=utf-8"


def _exemplar() -> dict | None:
    """The current request's trace and span ids, when tracing is on."""
    ids = tracing.current_ids() if tracing.enabled() else None
    return {"trace_id": ids[0], "span_id": ids[1]} if ids else None
