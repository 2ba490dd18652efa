"""A real OTLP/HTTP trace receiver on loopback for the tests: decodes what the server exports, span by span."""
from __future__ import annotations

import dataclasses
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclasses.dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    service: str


class OTLPReceiver:
    """POST /v1/traces (protobuf) on 127.0.0.1; `spans` grows as batches arrive. `stop()` closes the port."""

    def __init__(self, port: int = 0):
        self.spans: list[Span] = []
        self.batches = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's spelling)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                receiver._take(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _take(self, req: ExportTraceServiceRequest) -> None:
        with self._lock:
            self.batches += 1
            for rs in req.resource_spans:
                res = {a.key: _value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(Span(s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                               s.kind, s.start_time_unix_nano, s.end_time_unix_nano,
                                               {a.key: _value(a.value) for a in s.attributes},
                                               res.get("service.name", "")))

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, count: int, timeout: float = 15.0) -> list[Span]:
        """The spans of `trace_id` once `count` have arrived (the server exports once a second)."""
        deadline = time.monotonic() + timeout
        while len(spans := self.trace(trace_id)) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(spans)} of {count} spans of trace {trace_id} arrived in {timeout}s")
            time.sleep(0.05)
        return spans

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
