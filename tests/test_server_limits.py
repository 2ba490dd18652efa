"""Queue caps under a burst, the request timeout, and a client that never reads, on the real engine."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from support.metrics_text import delta, parse
from support.servers import (MODEL, OPS_MAX_QUEUED, OPS_MAX_QUEUED_TOKENS, OPS_STALL_S, OPS_TIMEOUT_S, OpsServer,
                             wait_idle)

pytestmark = pytest.mark.real_model


async def _burst(url: str, path: str, bodies: list[dict]) -> list[httpx.Response]:
    """Send every body at once, each on its own connection."""
    async with httpx.AsyncClient(base_url=url, headers=OpsServer.auth(), timeout=120,
                                 limits=httpx.Limits(max_connections=len(bodies))) as client:
        return await asyncio.gather(*(client.post(path, json=body) for body in bodies))


def _words(n: int, seed: int) -> str:
    return " ".join(f"w{(seed * 7919 + i) % 997}" for i in range(n))  # distinct prompts: no prefix sharing


def test_a_burst_past_max_queued_requests_is_refused_with_429(ops_server: OpsServer) -> None:
    wait_idle(ops_server.url)
    before = parse(ops_server.metrics())
    bodies = [{"model": MODEL, "messages": [{"role": "user", "content": _words(100, i)}], "max_tokens": 2}
              for i in range(2 * OPS_MAX_QUEUED)]
    n = httpx.post(ops_server.url + "/tokenize", json={"messages": bodies[0]["messages"]},
                   headers=OpsServer.auth()).json()["count"]
    assert 256 < n and OPS_MAX_QUEUED * (n + 16) < OPS_MAX_QUEUED_TOKENS  # several prefill steps; tokens not the cap
    responses = asyncio.run(_burst(ops_server.url, "/v1/chat/completions", bodies))
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(refused) == len(bodies) and len(ok) == OPS_MAX_QUEUED, [r.status_code for r in responses]
    for r in refused:
        err = r.json()["error"]
        assert err["code"] == "queue_full" and err["type"] == "rate_limit_error" and "max-queued-requests" in \
            err["message"]
        assert r.headers["retry-after"] == "1" and r.headers["x-request-id"]
    after = parse(ops_server.metrics())
    assert delta(before, after, "imp_requests_rejected_total", reason="queue_full") == len(refused)
    assert delta(before, after, "imp_requests_total") == len(ok)
    assert (after[("imp_queued_requests", ())], after[("imp_queued_prompt_tokens", ())]) == (0, 0)


def test_a_burst_past_max_queued_tokens_is_refused_as_overloaded(ops_server: OpsServer) -> None:
    wait_idle(ops_server.url)
    bodies = [{"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": _words(220, 50 + i)}]}
              for i in range(3)]
    counts = [httpx.post(ops_server.url + "/tokenize", json={"messages": b["messages"]},
                         headers=OpsServer.auth()).json()["count"] for b in bodies]
    assert all(OPS_MAX_QUEUED_TOKENS / 2 < n < 1000 for n in counts)  # one fits, two do not; ~13 prefill steps
    responses = asyncio.run(_burst(ops_server.url, "/v1/messages", bodies))
    assert sorted(r.status_code for r in responses) == [200, 429, 429], [r.text for r in responses]
    for r, n in zip(responses, counts, strict=True):   # whichever body got in: its own prompt's tokens
        if r.status_code == 429:  # Anthropic spells a full queue as overloaded (with a 429, not its 529)
            body = r.json()
            assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
            assert "max-queued-tokens" in body["error"]["message"] and body["request_id"] == r.headers["request-id"]
        else:
            assert r.json()["usage"]["input_tokens"] + r.json()["usage"]["cache_read_input_tokens"] >= n - 2


def test_request_timeout_ends_answers_with_what_they_have(ops_server: OpsServer) -> None:
    """Two requests of four choices each fill the engine's eight rows: 7,200 tokens could never come out
    within --request-timeout on a CPU (two choices alone finished all 900 tokens in 8 s on a fast machine)."""
    wait_idle(ops_server.url)
    before = parse(ops_server.metrics())
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 900,
            "ignore_eos": True, "n": 4}
    completion = {"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 900, "ignore_eos": True, "stream": True,
                  "n": 4, "stream_options": {"include_usage": True}}

    async def both() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=ops_server.url, headers=OpsServer.auth(), timeout=120) as client:
            return await asyncio.gather(
                client.post("/v1/chat/completions", json=chat, headers={"X-Request-Id": "timeout-1"}),
                client.post("/v1/completions", json=completion, headers={"X-Request-Id": "timeout-2"}))

    started = time.monotonic()
    whole, streamed = asyncio.run(both())
    elapsed = time.monotonic() - started
    assert OPS_TIMEOUT_S <= elapsed < OPS_TIMEOUT_S + 5
    assert whole.status_code == 200, whole.text
    assert [c["finish_reason"] for c in whole.json()["choices"]] == ["length"] * 4
    assert 0 < whole.json()["usage"]["completion_tokens"] < 4 * 900
    frames = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    finishes = [(c["index"], c["finish_reason"]) for f in frames for c in f["choices"] if c["finish_reason"]]
    assert sorted(finishes) == [(i, "length") for i in range(4)] and streamed.text.endswith("data: [DONE]\n\n")
    assert 0 < frames[-1]["usage"]["completion_tokens"] < 4 * 900
    after = parse(ops_server.metrics())
    assert delta(before, after, "imp_requests_timed_out_total") == 2
    assert delta(before, after, "imp_requests_cancelled_total") == 0
    lines = [e for e in ops_server.log_lines() if e.get("client_request_id") in ("timeout-1", "timeout-2")]
    assert [e["outcome"] for e in lines] == ["timed_out", "timed_out"]
    assert all(e["finish_reasons"] == ["length"] * 4 and e["status"] == 200 for e in lines)


def test_a_client_that_never_reads_is_dropped(ops_server: OpsServer) -> None:
    """The stream's frames are big (20 logprobs each) and the client's receive window tiny: within a
    few hundred KiB the server's writes block, its per-request buffer fills, and after
    --stream-stall-timeout the client is dropped and the request cancelled, long before max_tokens."""
    wait_idle(ops_server.url)
    before = parse(ops_server.metrics())
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Count to a thousand."}],
                       "max_tokens": 900, "ignore_eos": True, "stream": True, "logprobs": True,
                       "top_logprobs": 20}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", ops_server.live.port))
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {OpsServer.auth()['Authorization'][7:]}\r\n".encode()
                     + f"X-Request-Id: never-reads\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + OPS_TIMEOUT_S + OPS_STALL_S + 10
        while delta(before, after := parse(ops_server.metrics()), "imp_slow_clients_dropped_total") < 1:
            assert time.monotonic() < deadline, "the stalled client was not dropped"
            time.sleep(0.2)
        idle = wait_idle(ops_server.url, timeout=10)
    finally:
        sock.close()
    assert idle["num_free_blocks"] == idle["baseline_free_blocks"]
    assert delta(before, after, "imp_requests_cancelled_total") == 0
    (line,) = [e for e in ops_server.log_lines() if e.get("client_request_id") == "never-reads"]
    assert line["outcome"] == "dropped" and line["completion_tokens"] < 900
    assert "the client read nothing for" in ops_server.live.log_text()
