"""An in-process OTLP/HTTP trace collector for tests: ``POST /v1/traces`` with protobuf bodies
(what OpenTelemetry's OTLP/HTTP exporter sends), decoded with OpenTelemetry's own proto classes and
kept as plain dicts."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

Span = dict[str, Any]
KINDS = {1: "internal", 2: "server", 3: "client"}


def _value(v: AnyValue) -> Any:
    field = v.WhichOneof("value")
    if field == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, field) if field else None


def _span(resource: dict[str, Any], s: Any) -> Span:
    return {
        "name": s.name,
        "trace_id": s.trace_id.hex(),
        "span_id": s.span_id.hex(),
        "parent_span_id": s.parent_span_id.hex() or None,
        "kind": KINDS.get(s.kind, str(s.kind)),
        "start_ns": s.start_time_unix_nano,
        "end_ns": s.end_time_unix_nano,
        "attributes": {kv.key: _value(kv.value) for kv in s.attributes},
        "events": [e.name for e in s.events],
        "error": s.status.code == 2,
        "resource": resource,
    }


class OtlpCollector:
    def __init__(self) -> None:
        self.spans: list[Span] = []
        lock = self.lock = threading.Lock()
        spans = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                req = ExportTraceServiceRequest.FromString(body)
                got = []
                for rs in req.resource_spans:
                    resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
                    got += [_span(resource, s) for ss in rs.scope_spans for s in ss.spans]
                with lock:
                    spans.extend(got)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpCollector:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def wait(self, pred: Callable[[list[Span]], bool], timeout: float = 30.0) -> list[Span]:
        """The spans received once ``pred`` holds for them (or at the timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                got = list(self.spans)
            if pred(got) or time.monotonic() > deadline:
                return got
            time.sleep(0.2)
