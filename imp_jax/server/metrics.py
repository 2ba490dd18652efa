"""The app's own Prometheus series (served by `GET /metrics`, admin.py).

Request-level series (counts, tokens, the four latency ladders, outcomes) are observed here as
requests end; engine-level ones are read from the engine's counters at scrape time
(engine_metrics.py), so the engine thread never waits on a metric. Every series, each endpoint's
included, exists at zero before the first request.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from imp_jax.server.request_record import RequestRecord

ENDPOINTS = {"/v1/chat/completions": "chat_completions", "/v1/completions": "completions",
             "/v1/messages": "messages", "/v1/responses": "responses", "/infill": "infill",
             "/v1/score": "score", "/v1/decide": "decide",
             "/v1/embeddings": "embeddings", "/v1/rerank": "rerank", "/rerank": "rerank"}
REJECTIONS = {"invalid_api_key": "auth", "rate_limit_exceeded": "rate_limit", "queue_full": "queue_full",
              "request_too_large": "body_too_large", "auth_failures_exceeded": "auth_failures",
              "concurrency_limit_exceeded": "key_concurrency", "key_queue_full": "key_queue_full",
              "tokens_per_minute_exceeded": "tokens_per_minute"}
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5.0)


class Ladder:
    """A latency histogram twice: the unlabelled total, and per `endpoint`."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], registry: CollectorRegistry):
        self.total = Histogram(f"imp_{name}", doc, buckets=buckets, registry=registry)
        self.per_endpoint = Histogram(f"imp_endpoint_{name}", f"{doc}, per endpoint", ["endpoint"],
                                      buckets=buckets, registry=registry)
        for endpoint in ENDPOINTS.values():
            self.per_endpoint.labels(endpoint)

    def observe(self, endpoint: str, value: float) -> None:
        self.total.observe(value)
        self.per_endpoint.labels(endpoint).observe(value)


class ServerMetrics:
    """The series the server itself observes, in `registry`."""

    def __init__(self, registry: CollectorRegistry):
        r = registry

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, list(labels), registry=r)

        self.requests = counter("imp_requests", "Generation requests the engine took, counted when they end")
        self.endpoint_requests = counter("imp_endpoint_requests", "Generation requests, per endpoint", ("endpoint",))
        self.prompt_tokens = counter("imp_prompt_tokens", "Prompt tokens of the generation requests")
        self.generated_tokens = counter("imp_generated_tokens", "Tokens generated (every choice)")
        self.cached_tokens = counter("imp_tokens_cached", "Prompt tokens served from the prefix cache, as "
                                     "reported in usage")
        self.timed_out = counter("imp_requests_timed_out", "Requests the server ended at --request-timeout "
                                 "(the client sees finish_reason length)")
        self.cancelled = counter("imp_requests_cancelled", "Requests cancelled because the client disconnected")
        self.dropped = counter("imp_slow_clients_dropped", "Streams dropped because the client stopped reading "
                               "(--stream-stall-timeout)")
        self.failed = counter("imp_requests_failed", "Generation requests that ended with an engine error")
        self.rejected = counter("imp_requests_rejected", "Requests refused before any work, by reason",
                                ("reason",))
        self.otlp_exported = counter("imp_otlp_spans_exported", "Spans the OTLP collector accepted")
        self.otlp_failed = counter("imp_otlp_export_failures", "Spans whose export to the OTLP collector failed")
        self.otlp_unsampled = counter("imp_otlp_unsampled_requests", "Generation requests whose traceparent "
                                      "asked not to sample them (no span exported)")
        self.request_log_dropped = counter("imp_request_log_dropped", "Request-log lines dropped because the "
                                           "writer fell behind")
        self.duration = Ladder("request_duration_seconds", "Generation request time, arrival to last byte",
                               DURATION_BUCKETS, r)
        self.ttft = Ladder("ttft_seconds", "Arrival to the first generated token", TTFT_BUCKETS, r)
        self.queue_time = Ladder("queue_time_seconds", "Submission to the scheduler's first batch (or to the end "
                                 "of a request that never reached one)", QUEUE_BUCKETS, r)
        self.inter_token = Ladder("inter_token_seconds", "Time between consecutive tokens of one choice",
                                  INTER_TOKEN_BUCKETS, r)
        for endpoint in ENDPOINTS.values():
            self.endpoint_requests.labels(endpoint)
        for reason in REJECTIONS.values():
            self.rejected.labels(reason)

    def observe_gaps(self, endpoint: str, gaps: list[float]) -> None:
        for gap in gaps:
            self.inter_token.observe(endpoint, gap)

    def observe(self, rec: RequestRecord) -> None:
        """Count a request that ended: rejections for every route, the rest for generation requests."""
        reason = REJECTIONS.get(rec.error_code or "")
        if reason is not None and rec.status in (401, 413, 429):
            self.rejected.labels(reason).inc()
        if not rec.generated or rec.endpoint is None:
            return
        endpoint = rec.endpoint
        self.requests.inc()
        self.endpoint_requests.labels(endpoint).inc()
        self.prompt_tokens.inc(rec.prompt_tokens)
        self.generated_tokens.inc(rec.completion_tokens)
        self.cached_tokens.inc(rec.cached_tokens)
        self.duration.observe(endpoint, rec.duration_s)
        if rec.ttft_s is not None:
            self.ttft.observe(endpoint, rec.ttft_s)
        if rec.queue_s is not None:
            self.queue_time.observe(endpoint, rec.queue_s)
        outcome = {"timed_out": self.timed_out, "cancelled": self.cancelled, "dropped": self.dropped,
                   "error": self.failed}.get(rec.outcome or "")
        if outcome is not None:
            outcome.inc()

