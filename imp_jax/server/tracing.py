"""OpenTelemetry spans for generation requests, exported over OTLP/HTTP (JSON or protobuf) in the background.

One SERVER span per generation request, named after its route, with `queue`, `prefill` and
`decode` children on its timeline. A W3C `traceparent` puts it inside the caller's trace; a
parent whose sampled flag is clear is honoured (ids minted, nothing exported). Spans are built
when the request has ended, from its record, and handed to a BatchSpanProcessor thread that
exports once a second: an unreachable collector costs one warning per outage and the dropped
spans, counted in `imp_otlp_export_failures_total`, never request latency. Without an endpoint,
ids are still minted (for the request log) and nothing is recorded.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from imp_jax.server.metrics import ServerMetrics
from imp_jax.server.otlp_json import OTLPJSONSpanExporter
from imp_jax.server.request_record import RequestRecord, capped_error

log = logging.getLogger("imp_jax.server")
EXPORT_TIMEOUT_S = 5.0        # one batch's export, retries included
EXPORT_INTERVAL_MS = 1000
OTLP_LOGGER = "opentelemetry.exporter.otlp"  # its per-batch errors are replaced by CountingExporter's one warning


class CountingExporter(SpanExporter):
    """Wraps the OTLP exporter: counts exported and failed spans, warns once when export starts failing."""

    def __init__(self, inner: SpanExporter, endpoint: str, metrics: ServerMetrics):
        self._inner, self._endpoint, self._metrics = inner, endpoint, metrics
        self._failing = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self._inner.export(spans)
        except Exception as e:  # an exporter bug must not kill the export thread
            log.debug("OTLP export raised: %s", e)
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self._metrics.otlp_exported.inc(len(spans))
            if self._failing:
                self._failing = False
                log.info("OTLP export to %s works again", self._endpoint)
        else:
            self._metrics.otlp_failed.inc(len(spans))
            if not self._failing:
                self._failing = True
                log.warning("OTLP export to %s failed; spans are dropped until it answers "
                            "(counted in imp_otlp_export_failures_total)", self._endpoint)
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class Tracing:
    """Makes the spans of ended generation requests; `endpoint` None: ids only."""

    def __init__(self, endpoint: str | None, service_name: str, metrics: ServerMetrics,
                 protocol: str = "http/json"):
        self.endpoint = endpoint
        self._metrics = metrics
        sampler = ParentBased(ALWAYS_ON) if endpoint else ALWAYS_OFF
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}), sampler=sampler,
                                        shutdown_on_exit=False)
        if endpoint:
            logging.getLogger(OTLP_LOGGER).setLevel(logging.CRITICAL)
            inner = (OTLPJSONSpanExporter(endpoint, EXPORT_TIMEOUT_S) if protocol == "http/json"
                     else OTLPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S))
            exporter = CountingExporter(inner, endpoint, metrics)
            self._provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_INTERVAL_MS))
            log.info("OTLP: exporting spans to %s (%s, service.name %s)", endpoint, protocol, service_name)
        self._tracer = self._provider.get_tracer("imp_jax.server")
        self._propagator = TraceContextTextMapPropagator()

    def record(self, rec: RequestRecord) -> None:
        """Mint the request's trace and span ids (into `rec`) and, when sampled, record its spans."""
        parent = self._propagator.extract({"traceparent": rec.traceparent} if rec.traceparent else {})
        end = rec.ended_at or rec.finished_at or rec.arrival
        span = self._tracer.start_span(rec.route or rec.path, context=parent, kind=SpanKind.SERVER,
                                       start_time=rec.wall_ns(rec.arrival))
        ctx = span.get_span_context()
        rec.trace_id, rec.span_id = format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")
        if not span.is_recording():
            if self.endpoint:
                self._metrics.otlp_unsampled.inc()
            span.end()
            return
        span.set_attributes(_attributes(rec))
        if rec.outcome == "error" or (rec.status or 0) >= 500:
            span.set_status(Status(StatusCode.ERROR, capped_error(rec.error_message) or "engine error"))
        inside = trace.set_span_in_context(span)
        for name, start, stop in _phases(rec, end):
            child = self._tracer.start_span(name, context=inside, kind=SpanKind.INTERNAL, start_time=rec.wall_ns(start))
            child.end(end_time=rec.wall_ns(stop))
        span.end(end_time=rec.wall_ns(end))

    def shutdown(self) -> None:
        """Export what is queued (bounded by the export timeout) and stop the export thread."""
        self._provider.shutdown()


def _phases(rec: RequestRecord, end: float) -> list[tuple[str, float, float]]:
    """queue (submitted -> first batch), prefill (-> first token), decode (-> last event)."""
    if rec.submitted_at is None:
        return []
    finished = rec.finished_at or end
    queue_end = rec.admitted_at or rec.first_token_at or finished
    phases = [("queue", rec.submitted_at, queue_end)]
    if rec.admitted_at is not None and rec.first_token_at is not None:
        phases.append(("prefill", rec.admitted_at, rec.first_token_at))
    if rec.first_token_at is not None:
        phases.append(("decode", rec.first_token_at, finished))
    return phases


def _attributes(rec: RequestRecord) -> dict[str, object]:
    attrs: dict[str, object] = {
        "imp.request_id": rec.server_id, "gen_ai.request.model": rec.model or "",
        "gen_ai.usage.input_tokens": rec.prompt_tokens, "gen_ai.usage.output_tokens": rec.completion_tokens,
        "imp.cached_tokens": rec.cached_tokens, "gen_ai.response.finish_reasons": rec.finish_reason_list,
        "imp.stream": rec.stream, "imp.outcome": rec.outcome or "", "http.request.method": rec.method,
        "http.route": rec.route or rec.path,
    }
    if rec.client_id:
        attrs["imp.client_request_id"] = rec.client_id
    if rec.status is not None:
        attrs["http.response.status_code"] = rec.status
    if rec.queue_s is not None:
        attrs["imp.queue_ms"] = round(rec.queue_s * 1000, 3)
    if rec.ttft_s is not None:
        attrs["imp.ttft_ms"] = round(rec.ttft_s * 1000, 3)
    for key, value in (rec.spec or {}).items():   # imp_spec_drafted -> imp.spec_drafted, as imp names them
        attrs["imp." + key.removeprefix("imp_")] = value
    return attrs
