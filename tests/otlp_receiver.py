"""An OTLP/gRPC trace receiver (opentelemetry-proto's TraceService) for the tracing tests: the real
exporters of the processes under test send to it."""
from __future__ import annotations

import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

import servers
from tessera.bench.span_sink import value


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects every exported span as (service.name, span)."""

    def __init__(self) -> None:
        self.spans: list = []
        self.lock = threading.Lock()
        self.hang = threading.Event()      # set: every Export blocks until `release` (a receiver that hangs)
        self.release = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):
        if self.hang.is_set():
            self.release.wait(120)
        with self.lock:
            for rs in request.resource_spans:
                resource = {kv.key: value(kv.value) for kv in rs.resource.attributes}
                for ss in rs.scope_spans:
                    self.spans += [(resource, span) for span in ss.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list:
        with self.lock:
            return [(r, s) for r, s in self.spans if s.trace_id.hex() == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout_s: float = 20.0) -> list:
        servers.wait_until(lambda: names <= {s.name for _, s in self.trace(trace_id)}, timeout_s,
                           f"spans {sorted(names)} of trace {trace_id}")
        return self.trace(trace_id)


def attrs(span) -> dict:
    return {kv.key: value(kv.value) for kv in span.attributes}
