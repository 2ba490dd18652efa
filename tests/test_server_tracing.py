"""OpenTelemetry export, decoded by a real OTLP/HTTP receiver on loopback (tests/support/otlp_receiver.py)."""
from __future__ import annotations

import os
import statistics
import time

import httpx
import pytest
from support.otlp_receiver import OTLPReceiver, Span
from support.metrics_text import delta, parse
from support.servers import MODEL, OpsServer, wait_idle

pytestmark = pytest.mark.real_model

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 3,
        "temperature": 0}
SPEC_PROMPT = ("Repeat the following text exactly, word for word:\n\nThe lighthouse keeper climbed the spiral "
               "stairs every evening at dusk, counting the steps as his father had taught him. Below, the harbour "
               "filled with fishing boats returning from the grey northern sea.")   # copied: the drafts verify
SERVER_KIND, INTERNAL_KIND = 2, 1  # opentelemetry.proto.trace.v1.Span.SpanKind


def _traceparent(sampled: bool = True) -> tuple[str, str, str]:
    trace_id, span_id = os.urandom(16).hex(), os.urandom(8).hex()
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}", trace_id, span_id


def _chat(ops: OpsServer, headers: dict[str, str] | None = None, **body: object) -> httpx.Response:
    r = httpx.post(ops.url + "/v1/chat/completions", json={**CHAT, **body},
                   headers={**OpsServer.auth(), **(headers or {})}, timeout=60)
    assert r.status_code == 200, r.text
    return r


def _by_name(spans: list[Span]) -> dict[str, Span]:
    named = {s.name: s for s in spans}
    assert len(named) == len(spans), [s.name for s in spans]
    return named


def test_a_request_is_one_server_span_with_queue_prefill_and_decode(ops_server: OpsServer) -> None:
    header, trace_id, caller_span = _traceparent()
    r = _chat(ops_server, {"traceparent": header, "X-Request-Id": "trace-me"})
    spans = _by_name(ops_server.receiver.wait_for(trace_id, 4))
    assert set(spans) == {"/v1/chat/completions", "queue", "prefill", "decode"}
    root = spans["/v1/chat/completions"]
    assert root.kind == SERVER_KIND and root.parent_span_id == caller_span and root.service == "imp-test"
    assert root.encoding == "json" and "application/json" in ops_server.receiver.content_types   # imp's default
    usage = r.json()["usage"]
    attrs = root.attributes
    assert attrs["imp.request_id"] == r.json()["id"] and attrs["imp.client_request_id"] == "trace-me"
    assert attrs["gen_ai.request.model"] == MODEL and attrs["imp.stream"] is False
    assert attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert attrs["imp.cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert attrs["gen_ai.response.finish_reasons"] == [r.json()["choices"][0]["finish_reason"]]
    assert 0 <= attrs["imp.queue_ms"] <= attrs["imp.ttft_ms"]
    queue, prefill, decode = spans["queue"], spans["prefill"], spans["decode"]
    for child in (queue, prefill, decode):
        assert child.parent_span_id == root.span_id and child.kind == INTERNAL_KIND
    assert root.start_ns <= queue.start_ns <= queue.end_ns <= prefill.start_ns
    assert prefill.start_ns <= prefill.end_ns <= decode.start_ns <= decode.end_ns <= root.end_ns
    assert abs((prefill.end_ns - root.start_ns) / 1e6 - attrs["imp.ttft_ms"]) < 1.0
    deadline = time.monotonic() + 10
    while not (lines := [e for e in ops_server.log_lines() if e.get("client_request_id") == "trace-me"]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert (lines[0]["trace_id"], lines[0]["span_id"]) == (trace_id, root.span_id)


def test_the_span_carries_the_speculative_counters_usage_reports(ops_server: OpsServer) -> None:
    """A request whose verify steps ran: imp.spec_* on its span, the numbers of usage's imp_spec_*."""
    header, trace_id, _ = _traceparent()
    r = _chat(ops_server, {"traceparent": header}, messages=[{"role": "user", "content": SPEC_PROMPT}],
              max_tokens=30, temperature=0, speculative=True)
    details = r.json()["usage"]["completion_tokens_details"]
    assert details["imp_spec_verify_steps"] > 0, details
    root = _by_name(ops_server.receiver.wait_for(trace_id, 4))["/v1/chat/completions"]
    for key in ("drafted", "accepted", "emitted", "verify_steps"):
        assert root.attributes[f"imp.spec_{key}"] == details[f"imp_spec_{key}"]
    header, trace_id, _ = _traceparent()
    _chat(ops_server, {"traceparent": header}, speculative=False)   # no verify step: no counters
    root = _by_name(ops_server.receiver.wait_for(trace_id, 4))["/v1/chat/completions"]
    assert not any(k.startswith("imp.spec_") for k in root.attributes)


def test_without_a_traceparent_a_trace_is_minted(ops_server: OpsServer) -> None:
    r = httpx.post(ops_server.url + "/v1/messages", headers={**OpsServer.auth(), "X-Request-Id": "minted-1"},
                   json={"model": MODEL, "max_tokens": 3, "messages": CHAT["messages"], "stream": True}, timeout=60)
    assert r.status_code == 200
    deadline = time.monotonic() + 10
    while not (lines := [e for e in ops_server.log_lines() if e.get("client_request_id") == "minted-1"]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    spans = _by_name(ops_server.receiver.wait_for(lines[0]["trace_id"], 4))
    root = spans["/v1/messages"]
    assert root.parent_span_id == "" and root.span_id == lines[0]["span_id"]
    assert root.attributes["imp.stream"] is True and root.attributes["gen_ai.usage.output_tokens"] >= 1


def test_unsampled_and_refused_requests_export_nothing(ops_server: OpsServer) -> None:
    before = parse(ops_server.metrics())
    unsampled, unsampled_trace, _ = _traceparent(sampled=False)
    _chat(ops_server, {"traceparent": unsampled, "X-Request-Id": "unsampled-1"})
    refused, refused_trace, _ = _traceparent()
    bad = httpx.post(ops_server.url + "/v1/chat/completions", json={**CHAT, "n": 9},
                     headers={**OpsServer.auth(), "traceparent": refused})
    assert bad.status_code == 400
    marker, marker_trace, _ = _traceparent()
    _chat(ops_server, {"traceparent": marker})
    ops_server.receiver.wait_for(marker_trace, 4)   # exported in order: anything earlier has arrived
    assert ops_server.receiver.trace(unsampled_trace) == [] and ops_server.receiver.trace(refused_trace) == []
    after = parse(ops_server.metrics())
    assert delta(before, after, "imp_otlp_unsampled_requests_total") == 1
    assert delta(before, after, "imp_otlp_spans_exported_total") >= 4
    (line,) = [e for e in ops_server.log_lines() if e.get("client_request_id") == "unsampled-1"]
    assert line["trace_id"] == unsampled_trace  # ids are still minted in the caller's trace


def test_a_dead_collector_neither_fails_nor_slows_requests(ops_server: OpsServer) -> None:
    wait_idle(ops_server.url)

    def timed() -> float:
        started = time.perf_counter()
        _chat(ops_server)
        return time.perf_counter() - started

    def failures() -> float:
        return parse(ops_server.metrics())[("imp_otlp_export_failures_total", ())]

    up = statistics.median(timed() for _ in range(3))
    port = ops_server.receiver.port
    ops_server.receiver.stop()
    down: list[float] = []
    for _ in range(2):  # two failed batches, each failing after its retries ran out in the export thread
        before = failures()
        down.append(timed())
        deadline = time.monotonic() + 20
        while failures() == before:
            assert time.monotonic() < deadline, "the failed export was not counted"
            down.append(timed())  # while the export thread retries
            time.sleep(0.3)
    assert statistics.median(down) < 2 * up + 0.5, (up, down)
    warnings = [line for line in ops_server.live.log_text().splitlines() if "OTLP export" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0], warnings
    ops_server.receiver = OTLPReceiver(port)  # back up: spans flow again
    header, trace_id, _ = _traceparent()
    _chat(ops_server, {"traceparent": header})
    ops_server.receiver.wait_for(trace_id, 4, timeout=20)
    deadline = time.monotonic() + 5
    while "works again" not in ops_server.live.log_text():
        assert time.monotonic() < deadline, "recovery was not logged"
        time.sleep(0.05)
