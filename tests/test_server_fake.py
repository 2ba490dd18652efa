"""Server behaviour the real engine cannot be made to show on demand, checked over FakeEngine.

Faults mid-stream at a chosen token, the loading state, keepalive pings, FIM prompts (SmolLM2 has
no FIM tokens), and what the server hands the engine. Everything else, disconnects and n > 1
included, is tested end to end on the real engine; the real fault path in test_engine_contract.py.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
from support.servers import FAULT_MARKER, FakeEngine, fake_server, fake_tokenizer, parse_sse  # noqa: F401

from imp_jax.errors import ImpError
from imp_jax.runtime.request import EngineEvent, GenerationRequest, Usage
from imp_jax.server.app import create_app
from imp_jax.server.completions import CompletionRequest
from imp_jax.server.prompts import completion_prompt
from imp_jax.server.streaming import drive, sse

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}


def test_fault_mid_stream_ends_with_an_error_event(fake_server: tuple[str, FakeEngine]) -> None:
    url, _ = fake_server
    body = {**CHAT, "messages": [{"role": "user", "content": f"please {FAULT_MARKER}"}], "stream": True}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200
    frames = [data for _, data in parse_sse(r.text)]
    assert frames[-1] == "[DONE]"
    error = json.loads(frames[-2])["error"]
    assert error["code"] == "engine_faulted" and error["type"] == "server_error" and "injected" in error["message"]
    content = [json.loads(f)["choices"][0]["delta"].get("content", "") for f in frames[:-2]]
    assert "".join(content) == "The quick"
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIError, match="injected"):
        for _ in client.chat.completions.create(**body):
            pass


def test_fault_without_streaming_is_a_500_envelope(fake_server: tuple[str, FakeEngine]) -> None:
    url, _ = fake_server
    body = {"model": "fake-model", "prompt": f"{FAULT_MARKER} here", "max_tokens": 6}
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "engine_faulted"


def test_fim_prompt_is_prefix_suffix_middle() -> None:
    tok = fake_tokenizer(fim=True)
    req = CompletionRequest.model_validate({"model": "m", "prompt": "def f(x):", "suffix": "return x"})
    ids = completion_prompt(req, tok, tok.vocab_size)
    fim = {k: tok.token_to_id(v) for k, v in tok.fim_tokens.items()}
    assert ids[0] == fim["prefix"] and ids[-1] == fim["middle"] and fim["suffix"] in ids
    assert tok.decode(ids, skip_special_tokens=False) == "<fim_prefix>def f(x):<fim_suffix>return x<fim_middle>"


def test_loading_engine_answers_503_loading_but_health_200() -> None:
    async def run() -> None:
        engine = FakeEngine(fake_tokenizer())  # never started: stays "loading"
        client = create_app(engine).test_client()
        assert (await client.get("/health")).status_code == 200
        ready = await client.get("/ready")
        assert ready.status_code == 503 and (await ready.get_json())["code"] == "loading"
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and (await r.get_json())["error"]["code"] == "loading"
        models = await (await client.get("/v1/models")).get_json()
        assert models["data"][0]["loaded"] is False
    asyncio.run(run())


class _Fmt:
    """A formatter that records what the driver asked of it."""

    def open(self) -> list[str]:
        return [sse({"open": True})]

    def event(self, ev: EngineEvent) -> list[str]:
        return [sse({"text": ev.text})]

    def close(self, usage: Usage | None) -> list[str]:
        return [sse({"usage": usage.completion_tokens if usage else None})]

    def error(self, err: ImpError) -> list[str]:
        return [sse({"error": err.code}, event="error")]

    def ping(self) -> list[str]:
        return [": ping\n\n"]


class _Engine:
    def __init__(self) -> None:
        self.cancelled: list[str] = []

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)


async def _slow_events(raise_after: int | None = None) -> AsyncIterator[EngineEvent]:
    yield EngineEvent("r", text="a")
    await asyncio.sleep(0.25)
    if raise_after is not None:
        raise RuntimeError("engine bug")
    yield EngineEvent("r", text="b", finish_reason="stop", usage=Usage(1, 2, 0), done=True)


def test_driver_sends_keepalives_while_waiting() -> None:
    async def run() -> list[str]:
        engine = _Engine()
        frames = [f async for f in drive(engine, "r", _slow_events(), _Fmt(), keepalive_s=0.05)]  # type: ignore[arg-type]
        assert engine.cancelled == []
        return frames
    frames = asyncio.run(run())
    assert frames[0] == sse({"open": True}) and frames[1] == sse({"text": "a"})
    assert ": ping\n\n" in frames[2:-2] and frames[-2:] == [sse({"text": "b"}), sse({"usage": 2})]


def test_driver_turns_an_exception_into_the_error_event_and_cancels() -> None:
    async def run() -> tuple[list[str], list[str]]:
        engine = _Engine()
        frames = [f async for f in drive(engine, "r", _slow_events(raise_after=1), _Fmt())]  # type: ignore[arg-type]
        return frames, engine.cancelled
    frames, cancelled = asyncio.run(run())
    assert frames[-1] == sse({"error": "internal_error"}, event="error") and cancelled == ["r"]


def test_driver_cancels_when_the_consumer_goes_away() -> None:
    async def run() -> list[str]:
        engine = _Engine()
        stream = drive(engine, "r", _slow_events(), _Fmt())  # type: ignore[arg-type]
        await anext(stream)
        await anext(stream)
        await stream.aclose()
        return engine.cancelled
    assert asyncio.run(run()) == ["r"]


def test_generation_request_carries_priority_and_cache_prompt(fake_server: tuple[str, FakeEngine]) -> None:
    url, engine = fake_server
    seen: list[GenerationRequest] = []
    original = engine.generate
    engine.generate = lambda req, *a: (seen.append(req), original(req, *a))[1]  # type: ignore[method-assign]
    try:
        r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "priority": -3, "cache_prompt": True,
                                                           "user": "u1", "seed": 5, "top_k": 7}, timeout=30)
    finally:
        engine.generate = original  # type: ignore[method-assign]
    assert r.status_code == 200
    (req,) = seen
    assert (req.priority, req.cache_prompt, req.params.seed, req.params.top_k) == (-3, True, 5, 7)
    assert req.request_id == r.json()["id"] == r.headers["x-request-id"]


def test_events_dropped_unread_still_end_their_request(tmp_path) -> None:
    """A stream whose body never starts (the client left between the handler and its first frame) is
    never iterated or closed; dropping its events must still cancel the request and report it, at once,
    even with a --request-timeout timer pending. Only reachable in process: no client can time it."""
    from quart import g

    from imp_jax.runtime.request import GenerationRequest, SamplingParams
    from imp_jax.server import lifecycle
    from imp_jax.server.config import ServerConfig
    from imp_jax.server.request_record import RequestRecord

    async def run() -> RequestRecord:
        engine = FakeEngine(fake_tokenizer(), token_delay=0.01)
        engine.state = "ready"
        app = create_app(engine, ServerConfig(request_timeout=30, log_requests=str(tmp_path / "log.jsonl")))
        async with app.test_app(), app.test_request_context("/v1/chat/completions", method="POST"):
            g.record = record = RequestRecord("POST", "/v1/chat/completions", "r1", response_done=True)
            events = await lifecycle.begin(engine, GenerationRequest("r1", [1, 2, 3], SamplingParams(max_tokens=50)),
                                           stream=True)
            del events
            assert engine.cancelled_ids == ["r1"]
            return record

    record = asyncio.run(run())
    assert record.outcome == "cancelled" and record.reported
    line = json.loads((tmp_path / "log.jsonl").read_text())
    assert line["req_id"] == "r1" and line["outcome"] == "cancelled"


def test_steps_failed_total_is_on_health_and_metrics() -> None:
    """EngineCore.stats' steps_failed_total (a step that raised fails only its own requests): /health has it,
    0 from an engine that does not count it yet, and /metrics as the counter imp_engine_steps_failed_total."""
    from support.metrics_text import parse, value

    async def run() -> None:
        engine = FakeEngine(fake_tokenizer())
        engine.state = "ready"
        client = create_app(engine).test_client()
        engine.steps_failed_total = 3
        assert (await (await client.get("/health")).get_json())["steps_failed_total"] == 3
        metrics = parse(await (await client.get("/metrics")).get_data(as_text=True))
        assert value(metrics, "imp_engine_steps_failed_total") == 3
        engine.stats = lambda: {"num_running": 0, "num_waiting": 0}   # a core without the counter
        assert (await (await client.get("/health")).get_json())["steps_failed_total"] == 0
        assert value(parse(await (await client.get("/metrics")).get_data(as_text=True)),
                     "imp_engine_steps_failed_total") == 0
    asyncio.run(run())


def test_the_server_asks_capabilities_and_refuses_what_an_engine_lacks() -> None:
    """An engine without suspend, sessions, end_thinking or LoRA slots: each route is a 400 naming what is
    missing (never a 500 from a missing method), and /v1/models lists no adapters."""
    from imp_jax.runtime.api import Capabilities

    async def run() -> None:
        engine = FakeEngine(fake_tokenizer())
        engine.state = "ready"
        engine.capabilities = Capabilities()
        client = create_app(engine).test_client()
        for path, body, code in [("/admin/suspend", None, "not_supported"),
                                 ("/v1/sessions/s1/close", None, "not_supported"),
                                 ("/v1/requests/r1/end_thinking", None, "not_supported"),
                                 ("/admin/lora/load", {"path": "/tmp/adapter"}, "lora_disabled"),
                                 ("/admin/lora/unload", {"name": "a"}, "lora_disabled")]:
            r = await client.post(path, json=body)
            assert r.status_code == 400 and (await r.get_json())["error"]["code"] == code, (path, await r.get_data())
        assert [m["id"] for m in (await (await client.get("/v1/models")).get_json())["data"]] == ["fake-model"]
        assert engine.state == "ready"
    asyncio.run(run())


def test_ready_stays_200_while_idle_suspended(fake_server: tuple[str, FakeEngine]) -> None:
    """An idle suspend (--idle-unload-seconds) parks the weights but still takes requests (the next one
    resumes them): /ready is 200 with idle_suspended, as imp answers; /health says so too."""
    url, engine = fake_server
    engine.idle_suspended = True
    try:
        ready = httpx.get(url + "/ready")
        assert ready.status_code == 200 and ready.json()["ready"] is True and ready.json()["idle_suspended"] is True
    finally:
        engine.idle_suspended = False
    assert httpx.get(url + "/ready").json()["idle_suspended"] is False
