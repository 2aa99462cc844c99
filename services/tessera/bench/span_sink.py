"""An OTLP/gRPC trace receiver for the benchmarks (opentelemetry-proto's TraceService): the
processes under measure export to it with their real exporters, and it keeps each span as a
plain dict, all times in nanoseconds of the exporting machine's clock."""
from __future__ import annotations

import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class SpanSink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, keep: bool = True) -> None:
        """keep=False: count spans only (a cost benchmark need not hold them)."""
        self.keep, self.count, self.spans = keep, 0, []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(self, request, context):
        got = []
        for rs in request.resource_spans:
            resource = {kv.key: value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                got += [_plain(resource, s) for s in ss.spans] if self.keep else ss.spans
        with self.lock:
            self.count += len(got)
            if self.keep:
                self.spans += got
        return trace_service_pb2.ExportTraceServiceResponse()

    def stop(self) -> None:
        self.server.stop(0)


def _plain(resource: dict, s) -> dict:
    return {"trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(), "parent_span_id": s.parent_span_id.hex(),
            "name": s.name, "service": resource.get("service.name"), "instance": resource.get("service.instance.id"),
            "replica": resource.get("tessera.replica"), "stage": resource.get("tessera.stage"),
            "start_ns": s.start_time_unix_nano, "end_ns": s.end_time_unix_nano,
            "attributes": {kv.key: value(kv.value) for kv in s.attributes},
            "links": [{"trace_id": ln.trace_id.hex(), "span_id": ln.span_id.hex()} for ln in s.links]}
