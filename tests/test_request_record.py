"""RequestRecord's reports: the request-log line and the span carry an error's text capped."""
from __future__ import annotations

from prometheus_client import CollectorRegistry

from imp_jax.server.metrics import ServerMetrics
from imp_jax.server.request_record import MAX_ERROR_CHARS, RequestRecord, capped_error
from imp_jax.server.tracing import Tracing


def _failed(message: str) -> RequestRecord:
    rec = RequestRecord("POST", "/v1/chat/completions", "chatcmpl-1", status=400, outcome="error",
                        error_code="invalid_request_error", error_message=message)
    rec.ended_at = rec.arrival
    return rec


def test_an_error_of_any_size_is_logged_cut_to_a_kib_with_a_marker() -> None:
    huge = "x" * 100_000
    logged = _failed(huge).log_entry()["error"]
    assert logged == "x" * MAX_ERROR_CHARS + "... [cut: 100000 characters in all]"
    assert _failed("short").log_entry()["error"] == "short" and capped_error(None) is None


def test_a_span_carries_the_error_cut_to_a_kib() -> None:
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    tracing = Tracing("http://127.0.0.1:9/v1/traces", "imp-test", ServerMetrics(CollectorRegistry()))
    spans = InMemorySpanExporter()
    tracing._provider.add_span_processor(SimpleSpanProcessor(spans))
    try:
        tracing.record(_failed("y" * 100_000))
    finally:
        tracing._provider.shutdown()
    (span,) = [s for s in spans.get_finished_spans() if s.name == "/v1/chat/completions"]
    assert span.status.description == "y" * MAX_ERROR_CHARS + "... [cut: 100000 characters in all]"
