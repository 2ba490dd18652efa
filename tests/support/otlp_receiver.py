"""A real OTLP/HTTP trace receiver on loopback for the tests: decodes what the server exports, span by span.

It takes both encodings, as a collector does: application/x-protobuf and application/json (the
OTLP/JSON mapping: hex ids, integer enums, 64-bit integers as strings), and records which it got.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf.json_format import ParseDict
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def parse_json_request(body: bytes) -> ExportTraceServiceRequest:
    """An OTLP/JSON export body; strict about the spec's id rule (hex, 32/16 digits) so a base64 id fails."""
    doc = json.loads(body)
    for rs in doc.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for span in ss.get("spans", []):
                for key in ID_FIELDS:
                    if span.get(key):
                        raw = bytes.fromhex(span[key])   # ValueError on anything but hex
                        assert len(raw) == (16 if key == "traceId" else 8), (key, span[key])
                        span[key] = base64.b64encode(raw).decode()
    return ParseDict(doc, ExportTraceServiceRequest())


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
    encoding: str = "protobuf"   # what the batch came as: protobuf or json


class OTLPReceiver:
    """POST /v1/traces (protobuf or JSON) on 127.0.0.1; `spans` grows as batches arrive. `stop()` closes the port."""

    def __init__(self, port: int = 0):
        self.spans: list[Span] = []
        self.batches = 0
        self.content_types: list[str] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's spelling)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                ctype = self.headers.get("Content-Type", "").split(";")[0].strip()
                try:
                    if ctype == "application/json":
                        receiver._take(parse_json_request(body), "json", ctype)
                        reply, reply_type = b"{}", "application/json"
                    else:
                        receiver._take(ExportTraceServiceRequest.FromString(body), "protobuf", ctype)
                        reply, reply_type = ExportTraceServiceResponse().SerializeToString(), "application/x-protobuf"
                    status = 200
                except Exception as e:  # a malformed body is the exporter's bug: answer 400, as a collector does
                    reply, reply_type, status = str(e).encode(), "text/plain", 400
                self.send_response(status)
                self.send_header("Content-Type", reply_type)
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

    def _take(self, req: ExportTraceServiceRequest, encoding: str, content_type: str) -> None:
        with self._lock:
            self.batches += 1
            self.content_types.append(content_type)
            for rs in req.resource_spans:
                res = {a.key: _value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(Span(s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                               s.kind, s.start_time_unix_nano, s.end_time_unix_nano,
                                               {a.key: _value(a.value) for a in s.attributes},
                                               res.get("service.name", ""), encoding))

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
