"""Telemetry: where a finished RequestRecord goes: the metrics, a span, a request-log line. One per app."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

from imp_jax.server.admission import AdmissionGate
from imp_jax.server.config import ServerConfig
from imp_jax.server.engine_metrics import EngineCollector
from imp_jax.server.metrics import ServerMetrics
from imp_jax.server.request_log import RequestLog
from imp_jax.server.request_record import RequestRecord
from imp_jax.server.tracing import Tracing

log = logging.getLogger("imp_jax.server")
UNLOGGED_PATHS = frozenset({"/health", "/ready", "/metrics"})  # probes and scrapes would drown the log


class Telemetry:
    """The app's registry (never the process-global one: several apps may share a process), tracing and log."""

    def __init__(self, config: ServerConfig, gate: AdmissionGate, engine_stats: Callable[[], dict[str, Any]],
                 model: Callable[[], tuple[str, bool]], store_stats: Callable[[], dict[str, int]]):
        self.registry = CollectorRegistry()
        self.metrics = ServerMetrics(self.registry)
        self.registry.register(EngineCollector(engine_stats, model, gate, store_stats))
        self.tracing = Tracing(config.otlp_endpoint, config.otlp_service_name, self.metrics,
                               config.otlp_protocol)
        self.request_log = (RequestLog(config.log_requests, self.metrics.request_log_dropped.inc)
                            if config.log_requests else None)

    def report_if_complete(self, rec: RequestRecord) -> None:
        """Report `rec` once, when its response is sent and its events are over."""
        if rec.reported or not rec.is_complete:
            return
        rec.reported = True
        rec.ended_at = time.monotonic()
        try:
            if rec.generated:
                self.tracing.record(rec)
            self.metrics.observe(rec)
            if self.request_log is not None and rec.path not in UNLOGGED_PATHS:
                self.request_log.write(rec.log_entry())
        except Exception:  # telemetry must never fail a request
            log.exception("reporting request %s failed", rec.server_id)

    def close(self) -> None:
        self.tracing.shutdown()
        if self.request_log is not None:
            self.request_log.close()
