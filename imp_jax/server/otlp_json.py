"""OTLP/HTTP with the JSON encoding (`--otlp-protocol http/json`, imp's): the SDK's exporter speaks only protobuf.

The spans are encoded by the SDK's own OTLP encoder into an ExportTraceServiceRequest and
printed with protobuf's canonical JSON mapping, which is what the OTLP/JSON spec asks for
(lowerCamelCase field names, enums as integers, 64-bit integers as strings) except for one
rule: trace and span ids are hex strings, not base64. `to_otlp_json` applies that rule.
"""
from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from typing import Any

import requests
from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def _hex(b64: str) -> str:
    return base64.b64decode(b64).hex()


def to_otlp_json(spans: Sequence[ReadableSpan]) -> dict[str, Any]:
    """The OTLP/JSON body of an export request for `spans`."""
    body = MessageToDict(encode_spans(spans), use_integers_for_enums=True)
    for rs in body.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for span in ss.get("spans", []):
                for item in [span, *span.get("links", [])]:
                    for key in ID_FIELDS:
                        if key in item:
                            item[key] = _hex(item[key])
    return body


class OTLPJSONSpanExporter(SpanExporter):
    """POSTs each batch as application/json to an OTLP/HTTP traces URL; any non-2xx answer is a failure."""

    def __init__(self, endpoint: str, timeout: float):
        self._endpoint, self._timeout = endpoint, timeout
        self._session = requests.Session()
        self._session.headers["Content-Type"] = "application/json"

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = json.dumps(to_otlp_json(spans), separators=(",", ":"))
        try:
            reply = self._session.post(self._endpoint, data=data, timeout=self._timeout)
        except requests.RequestException:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS if reply.ok else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self._session.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
