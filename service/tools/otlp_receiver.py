"""OTLP in: a minimal receiver (gRPC and HTTP/protobuf) and readers of OTLP JSON, down to plain span records.

For `lora-serve trace-summary`, the tests and the benchmarks; not a collector (no retries, no limits beyond
gRPC's): it keeps what it is sent in memory.

    sink = OtlpSink()
    receiver = GrpcReceiver(sink)            # or HttpReceiver(sink): POST /v1/traces, /v1/metrics
    # ... OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint ...
    spans = sink.spans()                     # list[SpanRecord]
"""
from __future__ import annotations

import base64
import gzip
import json
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

ExportTraces = trace_service_pb2.ExportTraceServiceRequest
ExportMetrics = metrics_service_pb2.ExportMetricsServiceRequest
_KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}


# --- records ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EventRecord:
    name: str
    time_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SpanRecord:
    trace_id: str   # 32 hex digits
    span_id: str    # 16 hex digits
    parent_id: str  # "" for a root span
    name: str
    start_ns: int
    end_ns: int
    kind: str = "INTERNAL"
    attributes: dict[str, Any] = field(default_factory=dict)
    events: tuple[EventRecord, ...] = ()
    links: tuple[tuple[str, str], ...] = ()  # (trace_id, span_id)
    status: str = "UNSET"                    # UNSET, OK or ERROR
    status_message: str = ""
    service: str = ""

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(frozen=True)
class HistogramPoint:
    name: str
    attributes: dict[str, Any]
    count: int
    sum: float


# --- from protobuf ---------------------------------------------------------------------------------------
def _value(v) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return None if kind is None else getattr(v, kind)


def _attrs(kvs) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def spans_from_proto(requests: Iterable[ExportTraces]) -> list[SpanRecord]:
    out = []
    for req in requests:
        for rs in req.resource_spans:
            service = str(_attrs(rs.resource.attributes).get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    out.append(SpanRecord(
                        trace_id=s.trace_id.hex(), span_id=s.span_id.hex(), parent_id=s.parent_span_id.hex(),
                        name=s.name, start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                        kind=_KINDS.get(s.kind, str(s.kind)), attributes=_attrs(s.attributes),
                        events=tuple(EventRecord(e.name, e.time_unix_nano, _attrs(e.attributes)) for e in s.events),
                        links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in s.links),
                        status=_STATUS.get(s.status.code, str(s.status.code)), status_message=s.status.message,
                        service=service))
    return out


def histograms_from_proto(requests: Iterable[ExportMetrics]) -> list[HistogramPoint]:
    out = []
    for req in requests:
        for rm in req.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.WhichOneof("data") == "histogram":
                        out += [HistogramPoint(m.name, _attrs(p.attributes), p.count, p.sum)
                                for p in m.histogram.data_points]
    return out


# --- OTLP JSON (hex ids, as the OTLP/JSON spec, the collector's file exporter and Jaeger's api_v3) -------
def to_otlp_json(request: ExportTraces) -> dict:
    """One export request as OTLP/JSON (lowerCamelCase, enums as integers, ids in hex)."""
    d = json_format.MessageToDict(request, use_integers_for_enums=True)
    for rs in d.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for s in ss.get("spans", []):
                for holder in (s, *s.get("links", [])):
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if holder.get(key):
                            holder[key] = base64.b64decode(holder[key]).hex()
    return d


def _json_id(value: str | None) -> str:
    if not value:
        return ""
    if len(value) in (16, 32) and all(c in "0123456789abcdefABCDEF" for c in value):
        return value.lower()
    return base64.b64decode(value).hex()  # standard protobuf JSON: base64


def _json_value(v: dict) -> Any:
    for key, value in v.items():
        if key == "arrayValue":
            return [_json_value(x) for x in value.get("values", [])]
        if key == "kvlistValue":
            return {kv["key"]: _json_value(kv.get("value", {})) for kv in value.get("values", [])}
        if key == "intValue":
            return int(value)
        return value
    return None


def _json_attrs(kvs: list | None) -> dict[str, Any]:
    return {kv["key"]: _json_value(kv.get("value", {})) for kv in kvs or []}


def _enum(value: Any, names: dict[int, str], prefix: str) -> str:
    if isinstance(value, int):
        return names.get(value, str(value))
    return str(value or names[0]).removeprefix(prefix)


def spans_from_json(doc: dict) -> list[SpanRecord]:
    """Spans of one OTLP/JSON document ({"resourceSpans": [...]}, or Jaeger api_v3's {"result": {...}})."""
    doc = doc.get("result", doc)
    out = []
    for rs in doc.get("resourceSpans", []):
        service = str(_json_attrs(rs.get("resource", {}).get("attributes")).get("service.name", ""))
        for ss in rs.get("scopeSpans", []):
            for s in ss.get("spans", []):
                status = s.get("status", {})
                out.append(SpanRecord(
                    trace_id=_json_id(s.get("traceId")), span_id=_json_id(s.get("spanId")),
                    parent_id=_json_id(s.get("parentSpanId")), name=s.get("name", ""),
                    start_ns=int(s.get("startTimeUnixNano", 0)), end_ns=int(s.get("endTimeUnixNano", 0)),
                    kind=_enum(s.get("kind", 0), _KINDS, "SPAN_KIND_"), attributes=_json_attrs(s.get("attributes")),
                    events=tuple(EventRecord(e.get("name", ""), int(e.get("timeUnixNano", 0)),
                                             _json_attrs(e.get("attributes"))) for e in s.get("events", [])),
                    links=tuple((_json_id(link.get("traceId")), _json_id(link.get("spanId")))
                                for link in s.get("links", [])),
                    status=_enum(status.get("code", 0), _STATUS, "STATUS_CODE_"),
                    status_message=status.get("message", ""), service=service))
    return out


def _json_documents(text: str) -> Iterator[dict]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:  # JSON lines: one export request per line
        for line in text.splitlines():
            if line.strip():
                yield json.loads(line)
        return
    yield from (doc if isinstance(doc, list) else [doc])


_OTLP_KEYS = ("resourceSpans", "resourceMetrics", "resourceLogs")  # a collector's file export mixes signals


def read_json_spans(path: str | Path) -> list[SpanRecord]:
    """The spans of an OTLP JSON file; ValueError (one line, no traceback needed) for anything else."""
    try:
        docs = list(_json_documents(Path(path).read_text()))
    except UnicodeDecodeError:
        raise ValueError("not OTLP JSON: not a text file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not OTLP JSON: not JSON ({e})") from None
    if not docs:
        raise ValueError("not OTLP JSON: the file is empty")
    spans = []
    for i, doc in enumerate(docs, 1):
        body = doc.get("result", doc) if isinstance(doc, dict) else None
        if not isinstance(body, dict) or not any(isinstance(body.get(k), list) for k in _OTLP_KEYS):
            raise ValueError(f"not OTLP JSON: document {i} is not an object with a resourceSpans list")
        try:
            spans += spans_from_json(doc)
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not OTLP JSON: document {i} has a malformed span ({type(e).__name__}: {e})") from None
    return spans


# --- the receiver ----------------------------------------------------------------------------------------
class OtlpSink:
    """Export requests received, in arrival order (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._traces: list[ExportTraces] = []
        self._metrics: list[ExportMetrics] = []

    def add(self, request: ExportTraces | ExportMetrics) -> None:
        with self._lock:
            (self._traces if isinstance(request, ExportTraces) else self._metrics).append(request)

    def trace_requests(self) -> list[ExportTraces]:
        with self._lock:
            return list(self._traces)

    def spans(self) -> list[SpanRecord]:
        return spans_from_proto(self.trace_requests())

    def metric_requests(self) -> list[ExportMetrics]:
        with self._lock:
            return list(self._metrics)

    def histograms(self) -> list[HistogramPoint]:
        with self._lock:
            requests = list(self._metrics)
        return histograms_from_proto(requests)

    def clear(self) -> None:
        with self._lock:
            self._traces.clear()
            self._metrics.clear()


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: OtlpSink):
        self._sink = sink

    def Export(self, request, context):
        self._sink.add(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class _MetricsService(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, sink: OtlpSink):
        self._sink = sink

    def Export(self, request, context):
        self._sink.add(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


class GrpcReceiver:
    """OTLP/gRPC (the collector's TraceService and MetricsService) on a thread pool."""

    def __init__(self, sink: OtlpSink, host: str = "127.0.0.1", port: int = 0):
        self._server = grpc.server(ThreadPoolExecutor(max_workers=4, thread_name_prefix="otlp-grpc"),
                                   options=[("grpc.so_reuseport", 0)])
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(sink), self._server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_MetricsService(sink), self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        if not self.port:
            raise OSError(f"cannot bind {host}:{port}")
        self.endpoint = f"http://{'127.0.0.1' if host in ('0.0.0.0', '[::]') else host}:{self.port}"
        self._server.start()

    def stop(self) -> None:
        self._server.stop(grace=None).wait()


class HttpReceiver:
    """OTLP/HTTP with protobuf bodies: POST /v1/traces and /v1/metrics."""

    def __init__(self, sink: OtlpSink, host: str = "127.0.0.1", port: int = 0):
        routes = {"/v1/traces": (ExportTraces, trace_service_pb2.ExportTraceServiceResponse),
                  "/v1/metrics": (ExportMetrics, metrics_service_pb2.ExportMetricsServiceResponse)}

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                route = routes.get(self.path)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if route is None:
                    self.send_error(404)
                    return
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request_type, response_type = route
                sink.add(request_type.FromString(body))
                payload = response_type().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args) -> None:  # quiet
                pass

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.endpoint = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="otlp-http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
