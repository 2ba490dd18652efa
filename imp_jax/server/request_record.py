"""RequestRecord: what one HTTP request did, from arrival to its last byte.

The app hooks open and close it; a generation request's events fill in its timeline
(submitted, admitted by the scheduler, first token, end) and token counts. Once both the
response and the events are over it is reported once, to metrics, tracing and the request log.
Times are `time.monotonic()`, the clock engine events carry.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from imp_jax.runtime.request import EngineEvent

# An error's text in the request log and in a span: it may quote client data (a field, a template's
# output), and one request must not write megabytes to the log or the trace collector.
MAX_ERROR_CHARS = 1024


def capped_error(text: str | None) -> str | None:
    """`text` cut to MAX_ERROR_CHARS, saying so and how long it was."""
    if text is None or len(text) <= MAX_ERROR_CHARS:
        return text
    return f"{text[:MAX_ERROR_CHARS]}... [cut: {len(text)} characters in all]"


@dataclasses.dataclass
class RequestRecord:
    """One request. `outcome` (generation only): ok, error, cancelled, timed_out or dropped."""

    method: str
    path: str
    server_id: str
    client_id: str | None = None
    client_addr: str | None = None
    traceparent: str | None = None
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    arrival_ns: int = dataclasses.field(default_factory=time.time_ns)
    route: str | None = None
    status: int | None = None
    error_code: str | None = None
    error_message: str | None = None
    # generation
    endpoint: str | None = None
    model: str | None = None
    stream: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    spec: dict[str, Any] | None = None   # usage's imp_spec_* counters, when speculative decoding ran
    submitted_at: float | None = None
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reasons: dict[int, str] = dataclasses.field(default_factory=dict)
    generating: bool = False   # events still to come
    generated: bool = False    # the engine took the request
    timed_out: bool = False
    stalled: bool = False
    outcome: str | None = None
    trace_id: str | None = None
    span_id: str | None = None
    response_done: bool = False
    reported: bool = False
    ended_at: float | None = None
    _last_token: dict[int, float] = dataclasses.field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ timeline
    def see(self, ev: EngineEvent) -> list[float]:
        """Take in one event; returns the inter-token gaps it closes (seconds, one per token)."""
        if ev.admitted_at is not None and self.admitted_at is None:
            self.admitted_at = ev.admitted_at
        gaps: list[float] = []
        if ev.token_ids:
            k = len(ev.token_ids)
            self.completion_tokens += k
            if self.first_token_at is None:
                self.first_token_at = ev.created_at
            last = self._last_token.get(ev.index)
            if last is not None:  # a coalesced event of k tokens closes k gaps of the mean size
                gaps = [(ev.created_at - last) / k] * k
            self._last_token[ev.index] = ev.created_at
        if ev.finish_reason is not None:
            self.finish_reasons[ev.index] = ev.finish_reason
        if ev.usage is not None:
            self.prompt_tokens = ev.usage.prompt_tokens
            self.completion_tokens = ev.usage.completion_tokens
            self.cached_tokens = ev.usage.cached_tokens
            if ev.usage.spec:
                self.spec = dict(ev.usage.spec)
        return gaps

    def mark_stalled(self) -> None:
        """The engine dropped the reader: the client stopped reading."""
        self.stalled = True

    def end_generation(self, outcome: str) -> None:
        self.generating = False
        self.outcome = outcome
        self.finished_at = time.monotonic()

    @property
    def is_complete(self) -> bool:
        """The response is sent and no events are still to come: time to report."""
        return self.response_done and not self.generating

    # ------------------------------------------------------------------ derived
    @property
    def queue_s(self) -> float | None:
        """Submission to the scheduler's first batch (or to the end, for a request that never got there)."""
        if self.submitted_at is None:
            return None
        end = self.admitted_at or self.first_token_at or self.finished_at
        return None if end is None else max(0.0, end - self.submitted_at)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def duration_s(self) -> float:
        return (self.ended_at or time.monotonic()) - self.arrival

    def wall_ns(self, t: float) -> int:
        """A monotonic time on the wall clock, in ns since the epoch (what spans carry)."""
        return self.arrival_ns + int((t - self.arrival) * 1e9)

    @property
    def finish_reason_list(self) -> list[str]:
        return [self.finish_reasons[i] for i in sorted(self.finish_reasons)]

    def log_entry(self) -> dict[str, Any]:
        """The request-log line."""
        ms = (lambda s: None if s is None else round(s * 1000, 3))
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(self.arrival_ns / 1e9))
            + f".{self.arrival_ns // 1_000_000 % 1000:03d}Z",
            "req_id": self.server_id, "client_request_id": self.client_id,
            "trace_id": self.trace_id, "span_id": self.span_id,
            "method": self.method, "route": self.route or self.path, "path": self.path, "status": self.status,
            "client": self.client_addr, "duration_ms": ms(self.duration_s),
        }
        if self.error_code is not None:
            entry.update(error_code=self.error_code, error=capped_error(self.error_message))
        if self.generated:
            entry.update(model=self.model, endpoint=self.endpoint, stream=self.stream, outcome=self.outcome,
                         finish_reasons=self.finish_reason_list, prompt_tokens=self.prompt_tokens,
                         completion_tokens=self.completion_tokens, cached_tokens=self.cached_tokens,
                         queue_ms=ms(self.queue_s), ttft_ms=ms(self.ttft_s))
        return entry
