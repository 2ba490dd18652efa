"""The streaming driver on the real engine: many concurrent clients, and clients that leave mid-stream."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from support.servers import MODEL, LiveServer, live_server, parse_sse, wait_idle  # noqa: F401

pytestmark = pytest.mark.real_model

PROMPTS = ["Name a fruit.", "What is 2 + 2?", "Say hello in French.", "Name a planet."]
MAX_TOKENS = 12


def _chat(prompt: str, stream: bool) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}


async def _stream(client: httpx.AsyncClient, prompt: str) -> tuple[str, dict]:
    """One streamed answer, checked frame by frame: role first, one finish, usage, then [DONE]."""
    r = await client.post("/v1/chat/completions", json=_chat(prompt, stream=True))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = parse_sse(r.text)
    assert frames[-1] == (None, "[DONE]")
    chunks = [json.loads(data) for _, data in frames[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finishes) == 1 and finishes[0] in ("stop", "length")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert r.headers["x-request-id"] == chunks[0]["id"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    return text, chunks[-1]["usage"]


def test_16_concurrent_streams_equal_the_non_streamed_answers(live_server: LiveServer) -> None:
    expected = {}
    for prompt in PROMPTS:
        r = httpx.post(live_server.url + "/v1/chat/completions", json=_chat(prompt, stream=False), timeout=120)
        expected[prompt] = r.json()["choices"][0]["message"]["content"]

    async def run() -> list[tuple[str, dict]]:
        async with httpx.AsyncClient(base_url=live_server.url, timeout=300,
                                     limits=httpx.Limits(max_connections=16)) as client:
            return await asyncio.gather(*(_stream(client, PROMPTS[i % len(PROMPTS)]) for i in range(16)))

    results = asyncio.run(run())
    for i, (text, usage) in enumerate(results):
        assert text == expected[PROMPTS[i % len(PROMPTS)]], f"client {i}"
    wait_idle(live_server.url)


def test_a_client_leaving_mid_stream_cancels_its_request(live_server: LiveServer) -> None:
    url = live_server.url
    baseline = wait_idle(url)
    body = {"model": MODEL, "prompt": "Count to one thousand:", "max_tokens": 1000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        data = (line for line in r.iter_lines() if line.startswith("data: "))
        rid = json.loads(next(data)[len("data: "):])["id"]
        next(data)
        busy = httpx.get(url + "/health").json()
        assert busy["num_running"] + busy["num_waiting"] == 1
        assert busy["num_free_blocks"] < baseline["num_free_blocks"]
    started = time.monotonic()
    idle = wait_idle(url, timeout=15)
    assert idle["num_free_blocks"] == idle["baseline_free_blocks"] == baseline["baseline_free_blocks"]
    assert time.monotonic() - started < 15  # far less than 1000 tokens take
    log = live_server.log_text()
    assert f"client left the stream of {rid}" in log
