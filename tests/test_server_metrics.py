"""`/metrics` and `--log-requests` on the real engine: series exist before traffic, and move as requests flow."""
from __future__ import annotations

import json
import time
from collections.abc import Iterable

import httpx
import pytest
from support.metrics_text import delta, parse, value
from support.servers import MODEL, OpsServer, wait_idle

pytestmark = pytest.mark.real_model

ENDPOINTS = ("chat_completions", "completions", "messages", "responses")
LADDERS = ("request_duration_seconds", "ttft_seconds", "queue_time_seconds", "inter_token_seconds")
ZERO_BEFORE_TRAFFIC = (
    "imp_requests_total", "imp_prompt_tokens_total", "imp_generated_tokens_total", "imp_tokens_cached_total",
    "imp_requests_timed_out_total", "imp_requests_cancelled_total", "imp_slow_clients_dropped_total",
    "imp_requests_failed_total", "imp_queue_depth", "imp_queue_waiting", "imp_queue_running",
    "imp_queued_requests", "imp_queued_prompt_tokens", "imp_kv_blocks_used", "imp_kv_blocks_reserved",
    "imp_prefix_cache_queries_total", "imp_prefix_cache_hits_total", "imp_prefix_cache_evictions_total",
    "imp_prefix_cache_collisions_total",
    "imp_preemptions_total", "imp_kv_pressure_rejections_total", "imp_kv_pool_growths_total",
    "imp_decode_batch_last_rows",
    "imp_decode_batch_rows_total", "imp_decode_batch_steps_total", "imp_decode_batch_max",
    "imp_compilations_after_warmup_total", "imp_engine_steps_total", "imp_engine_steps_failed_total",
    "imp_responses_store_entries",
    "imp_constrained_steps_total", "imp_constrained_rows_total", "imp_constraint_mask_seconds_total",
    "imp_banned_rewinds_total", "imp_kv_host_tier_hits_total", "imp_kv_host_tier_misses_total",
    "imp_kv_host_tier_spills_total", "imp_kv_host_tier_evictions_total", "imp_kv_swap_refusals_total",
    "imp_kv_evicted_tokens_total", "imp_kv_host_tier_bytes", "imp_kv_host_tier_capacity_bytes",
    "imp_responses_store_bytes", "imp_responses_store_evictions_total", "imp_responses_store_expirations_total",
    "imp_otlp_spans_exported_total", "imp_otlp_export_failures_total", "imp_otlp_unsampled_requests_total",
    "imp_request_log_dropped_total",
    *(f"imp_{ladder}_count" for ladder in LADDERS),
)
def test_every_series_exists_at_zero_before_traffic(ops_server: OpsServer) -> None:
    m = parse(ops_server.first_metrics)
    for name in ZERO_BEFORE_TRAFFIC:
        assert value(m, name) == 0, name
    for endpoint in ENDPOINTS:
        assert value(m, "imp_endpoint_requests_total", endpoint=endpoint) == 0
        for ladder in LADDERS:
            assert value(m, f"imp_endpoint_{ladder}_count", endpoint=endpoint) == 0
            assert value(m, f"imp_endpoint_{ladder}_bucket", endpoint=endpoint, le="+Inf") == 0
    for direction in ("out", "in"):   # the host KV tier is off on a CPU by default: every series reads 0
        assert value(m, "imp_kv_swaps_total", direction=direction) == 0
        assert value(m, "imp_kv_host_tier_copy_bytes_total", direction=direction) == 0
    for reason in ("auth", "rate_limit", "queue_full", "body_too_large"):
        assert value(m, "imp_requests_rejected_total", reason=reason) == 0
    assert value(m, "imp_model_loaded", model=MODEL) == 1
    assert value(m, "imp_kv_blocks_total") == 255 and value(m, "imp_kv_block_size") == 16


def _usage(url: str, path: str, body: dict, stream: bool) -> tuple[int, int, int]:
    """(prompt, completion, cached) tokens of one request, from its own usage."""
    r = httpx.post(url + path, json={**body, "stream": stream}, headers=OpsServer.auth(), timeout=60)
    assert r.status_code == 200, r.text
    if not stream:
        usage = r.json()["usage"]
    else:
        frames = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        usage = next(f.get("usage") or f.get("response", {}).get("usage") for f in reversed(frames)
                     if f.get("usage") or (f.get("response") or {}).get("usage"))
    if "prompt_tokens" in usage:  # Chat, Completions
        return usage["prompt_tokens"], usage["completion_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
    if "cache_read_input_tokens" in usage:  # Messages: input_tokens excludes the cache hit
        cached = usage["cache_read_input_tokens"]
        return usage["input_tokens"] + cached, usage["output_tokens"], cached
    return usage["input_tokens"], usage["output_tokens"], usage["input_tokens_details"]["cached_tokens"]


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name three rivers of Europe."}],
        "temperature": 0}
TRAFFIC: tuple[tuple[str, str, dict, bool], ...] = (
    ("chat_completions", "/v1/chat/completions", {**CHAT, "max_tokens": 6}, False),
    ("chat_completions", "/v1/chat/completions", {**CHAT, "max_tokens": 6}, False),   # a prefix-cache hit
    ("chat_completions", "/v1/chat/completions",
     {**CHAT, "max_tokens": 7, "stream_options": {"include_usage": True}}, True),
    # no max_tokens: --max-tokens applies; greedy and ignore_eos so the answer cannot end early on EOS
    ("completions", "/v1/completions",
     {"model": MODEL, "prompt": "The capital of France is", "temperature": 0, "ignore_eos": True}, False),
    ("messages", "/v1/messages", {"model": MODEL, "max_tokens": 5, "messages": CHAT["messages"]}, True),
    ("responses", "/v1/responses", {"model": MODEL, "input": "Say hi.", "max_output_tokens": 4}, True),
)


def test_counts_tokens_and_histograms_follow_the_traffic(ops_server: OpsServer) -> None:
    wait_idle(ops_server.url)
    before = parse(ops_server.metrics())
    usages: dict[str, list[tuple[int, int, int]]] = {e: [] for e in ENDPOINTS}
    for endpoint, path, body, stream in TRAFFIC:
        usages[endpoint].append(_usage(ops_server.url, path, body, stream))
    after = parse(ops_server.metrics())

    def total(items: Iterable[tuple[int, int, int]], i: int) -> int:
        return sum(u[i] for u in items)

    everything = [u for us in usages.values() for u in us]
    assert usages["completions"][0][1] == 5                     # --max-tokens 5 was its default
    assert total(usages["chat_completions"][1:2], 2) > 0         # the repeat hit the prefix cache
    assert delta(before, after, "imp_requests_total") == len(TRAFFIC)
    assert delta(before, after, "imp_prompt_tokens_total") == total(everything, 0)
    assert delta(before, after, "imp_generated_tokens_total") == total(everything, 1)
    assert delta(before, after, "imp_tokens_cached_total") == total(everything, 2)
    for ladder in LADDERS[:3]:  # every request is observed once by the duration, TTFT and queue ladders
        assert delta(before, after, f"imp_{ladder}_count") == len(TRAFFIC), ladder
    assert delta(before, after, "imp_inter_token_seconds_count") == total(everything, 1) - len(TRAFFIC)
    for endpoint, us in usages.items():
        assert delta(before, after, "imp_endpoint_requests_total", endpoint=endpoint) == len(us)
        assert delta(before, after, "imp_endpoint_ttft_seconds_count", endpoint=endpoint) == len(us)
        assert delta(before, after, "imp_endpoint_inter_token_seconds_count", endpoint=endpoint) == \
            total(us, 1) - len(us)
        assert delta(before, after, "imp_endpoint_request_duration_seconds_sum", endpoint=endpoint) > 0
    ttft_sum = delta(before, after, "imp_ttft_seconds_sum")
    assert 0 < ttft_sum < delta(before, after, "imp_request_duration_seconds_sum")
    assert delta(before, after, "imp_prefix_cache_hits_total") >= total(everything, 2)
    # every token after a request's first comes from a decode row, or from a draft accepted beside one
    # (n-gram speculation is on by default: an answer that repeats its prompt takes several tokens a row)
    assert (delta(before, after, "imp_decode_batch_rows_total") + delta(before, after, "imp_spec_accepted_total")
            >= total(everything, 1) - len(TRAFFIC))
    assert delta(before, after, "imp_decode_batch_steps_total") > 0 and value(after, "imp_decode_batch_max") >= 1
    assert delta(before, after, "imp_engine_steps_total") > 0
    assert value(after, "imp_responses_store_entries") >= 1 and value(after, "imp_responses_store_bytes") > 0
    for name in ("imp_queue_depth", "imp_queued_requests", "imp_queued_prompt_tokens", "imp_decode_batch_last_rows",
                 "imp_kv_blocks_used", "imp_compilations_after_warmup_total"):
        assert value(after, name) == 0, name


def test_a_client_that_leaves_is_counted_as_cancelled(ops_server: OpsServer) -> None:
    wait_idle(ops_server.url)
    before = parse(ops_server.metrics())
    body = {"model": MODEL, "prompt": "Count to one thousand:", "max_tokens": 500, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", ops_server.url + "/v1/completions", json=body, headers=OpsServer.auth(),
                      timeout=60) as r:
        data = (line for line in r.iter_lines() if line.startswith("data: "))
        next(data), next(data)
    wait_idle(ops_server.url, timeout=15)
    deadline = time.monotonic() + 10
    while delta(before, after := parse(ops_server.metrics()), "imp_requests_cancelled_total") < 1:
        assert time.monotonic() < deadline, "the cancellation was not counted"
        time.sleep(0.1)
    assert delta(before, after, "imp_requests_cancelled_total") == 1
    assert delta(before, after, "imp_requests_total") == 1
    assert delta(before, after, "imp_queue_time_seconds_count") == 1
    assert 2 <= delta(before, after, "imp_generated_tokens_total") < 500


def test_request_log_has_one_line_per_request(ops_server: OpsServer) -> None:
    rid = "client-trace-42"
    r = httpx.post(ops_server.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 3},
                   headers={**OpsServer.auth(), "X-Request-Id": rid}, timeout=60)
    assert r.status_code == 200
    refused = httpx.post(ops_server.url + "/v1/chat/completions", json={**CHAT, "n": 9}, headers=OpsServer.auth())
    assert refused.status_code == 400
    httpx.get(ops_server.url + "/health")  # probes are not logged
    deadline = time.monotonic() + 10
    while not any(line.get("client_request_id") == rid for line in ops_server.log_lines()):
        assert time.monotonic() < deadline, "no request-log line"
        time.sleep(0.05)
    lines = ops_server.log_lines()
    (line,) = [entry for entry in lines if entry.get("client_request_id") == rid]
    usage = r.json()["usage"]
    assert line["req_id"] == r.json()["id"] and line["route"] == "/v1/chat/completions" and line["status"] == 200
    assert line["model"] == MODEL and line["outcome"] == "ok" and line["finish_reasons"] == ["length"]
    assert (line["prompt_tokens"], line["completion_tokens"], line["cached_tokens"]) == (
        usage["prompt_tokens"], usage["completion_tokens"], usage["prompt_tokens_details"]["cached_tokens"])
    assert 0 <= line["queue_ms"] <= line["ttft_ms"] <= line["duration_ms"]
    assert len(line["trace_id"]) == 32 and len(line["span_id"]) == 16 and line["stream"] is False
    bad = [entry for entry in lines if entry["req_id"] == refused.headers["x-request-id"]]
    assert len(bad) == 1 and bad[0]["status"] == 400 and bad[0]["error_code"] == "invalid_request_error"
    assert "outcome" not in bad[0] and not any(entry["path"] == "/health" for entry in lines)
