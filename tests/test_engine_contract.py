"""The engine event contract, on the real AsyncEngine and on FakeEngine alike, and a real engine fault over HTTP.

The real engine here is an in-process AsyncEngine over the session's SmolLM2 load with test_engine's
sizing (its four step programs come from the persistent compilation cache). A device fault is a step
that raises: the AsyncEngine marks itself faulted and fails every request in flight, one error event
per open sequence, which every dialect must turn into its error answer.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jax.numpy as jnp
import pytest
from server_fixtures import (FAULT_MARKER, FakeEngine, app_in_thread, check_event_contract, fake_tokenizer,
                             parse_sse, wait_for)

from imp_jax.kernels_pallas import kv_storage_dtype
from imp_jax.runtime.async_engine import AsyncEngine
from imp_jax.runtime.builder import enable_compilation_cache
from imp_jax.runtime.config import EngineConfig
from imp_jax.runtime.engine import EngineCore
from imp_jax.runtime.request import EngineEvent, GenerationRequest, SamplingParams
from imp_jax.runtime.sharding import default_mesh
from imp_jax.server.app import create_app

pytestmark = pytest.mark.real_model

NUM_BLOCKS = 96  # test_engine's sizing: the same step programs
_ids = itertools.count()


def real_async_engine(loaded, gguf: Path) -> AsyncEngine:
    """A started AsyncEngine whose core is built on `loaded` (no second load), ready when returned."""
    config = EngineConfig(model=str(gguf), max_model_len=256, max_num_seqs=8, max_num_batched_tokens=16,
                          num_kv_blocks=NUM_BLOCKS)
    enable_compilation_cache(config)

    def build(config: EngineConfig, progress: Any) -> EngineCore:
        shape = loaded.model.kv_cache_shape(NUM_BLOCKS, config.block_size)
        kv = tuple(jnp.zeros(shape, kv_storage_dtype(loaded.dtype, "cpu")) for _ in range(2))
        core = EngineCore(loaded, config, kv, NUM_BLOCKS, default_mesh())
        core.step_fn.warm_up()
        return core

    engine = AsyncEngine(config, build=build)
    engine.start()
    asyncio.run(engine.wait_ready())
    return engine


@pytest.fixture(scope="module")
def real_engine(smollm2_loaded, smollm2_gguf_path: Path) -> Iterator[AsyncEngine]:
    engine = real_async_engine(smollm2_loaded, smollm2_gguf_path)
    yield engine
    engine.shutdown()


def request(engine: Any, text: str, **params: Any) -> GenerationRequest:
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    return GenerationRequest(f"contract-{next(_ids)}", ids, SamplingParams(**params))


async def events_of(engine: Any, req: GenerationRequest) -> list[EngineEvent]:
    return [ev async for ev in engine.generate(req)]


CASES = {
    "one": dict(max_tokens=5, ignore_eos=True),
    "n3": dict(n=3, max_tokens=4, temperature=1.0, seed=3, ignore_eos=True),
    "greedy_may_stop": dict(max_tokens=12, temperature=0.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_real_and_fake_engines_keep_the_same_event_contract(real_engine: AsyncEngine, case: str) -> None:
    fake = FakeEngine(fake_tokenizer())
    fake.state = "ready"
    for engine in (real_engine, fake):
        req = request(engine, "The capital of France is", **CASES[case])
        check_event_contract(asyncio.run(events_of(engine, req)), req, engine.tokenizer)
    assert real_engine.stats()["num_free_blocks"] == real_engine.stats()["baseline_free_blocks"]


def test_fake_fault_is_the_real_fault_contract() -> None:
    fake = FakeEngine(fake_tokenizer())
    fake.state = "ready"
    req = request(fake, f"please {FAULT_MARKER}", n=2, max_tokens=8)
    events = asyncio.run(events_of(fake, req))
    check_event_contract(events, req, fake.tokenizer, fault=True)
    assert [ev.index for ev in events if ev.finish_reason] == [0, 1]


def test_fake_refuses_what_only_the_real_engine_does() -> None:
    from imp_jax.errors import InvalidRequestError
    fake = FakeEngine(fake_tokenizer())
    fake.state = "ready"
    with pytest.raises(InvalidRequestError):
        asyncio.run(events_of(fake, request(fake, "hi", stop=["x"], max_tokens=3)))


# ------------------------------------------------------------------------------- a real device fault
CHAT = "/v1/chat/completions"
LONG = 200  # tokens asked for: the fault comes long before


def _bodies(model: str) -> dict[str, tuple[str, dict[str, Any]]]:
    user = [{"role": "user", "content": "Write a long story about a lighthouse."}]
    return {
        "chat_stream_n2": (CHAT, {"model": model, "messages": user, "max_tokens": LONG, "n": 2, "temperature": 1.0,
                                  "ignore_eos": True, "stream": True}),
        "chat": (CHAT, {"model": model, "messages": user, "max_tokens": LONG, "ignore_eos": True}),
        "completions_stream": ("/v1/completions", {"model": model, "prompt": "Once upon a time", "max_tokens": LONG,
                                                   "ignore_eos": True, "stream": True}),
        "messages_stream": ("/v1/messages", {"model": model, "messages": user, "max_tokens": LONG,
                                             "ignore_eos": True, "stream": True}),
        "messages": ("/v1/messages", {"model": model, "messages": user, "max_tokens": LONG, "ignore_eos": True}),
        "responses_stream": ("/v1/responses", {"model": model, "input": "Tell a story.", "max_output_tokens": LONG,
                                               "ignore_eos": True, "stream": True}),
        "responses": ("/v1/responses", {"model": model, "input": "Tell a story.", "max_output_tokens": LONG,
                                        "ignore_eos": True}),
    }


def test_a_device_fault_fails_every_request_in_each_dialect(smollm2_loaded, smollm2_gguf_path: Path) -> None:
    engine = real_async_engine(smollm2_loaded, smollm2_gguf_path)
    core = engine.core
    armed = threading.Event()
    real_step = core.step

    def step() -> int:
        if armed.is_set():
            raise RuntimeError("injected device fault")
        return real_step()

    core.step = step  # type: ignore[method-assign]
    bodies = _bodies(engine.served_name)
    try:
        with app_in_thread(create_app(engine)) as url:
            wait_for(url + "/ready", 200, timeout=30)

            async def go() -> dict[str, httpx.Response]:
                async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                    sent = {name: asyncio.ensure_future(client.post(path, json=body))
                            for name, (path, body) in bodies.items()}
                    for _ in range(600):  # every sequence running and some tokens out, then the fault
                        stats = engine.stats()
                        if stats.get("num_running") == len(bodies) + 1 and stats.get("num_waiting") == 0:
                            break
                        await asyncio.sleep(0.05)
                    await asyncio.sleep(0.5)
                    armed.set()
                    return {name: await task for name, task in sent.items()}

            answers = asyncio.run(go())
            for name, r in answers.items():
                check_fault_answer(name, r)
            health = httpx.get(url + "/health")
            assert health.status_code == 503 and health.json()["code"] == "engine_faulted"
            again = httpx.post(url + CHAT, json=bodies["chat"][1])
            assert again.status_code == 500 and again.json()["error"]["code"] == "engine_faulted", again.text
            ready = httpx.get(url + "/ready")
            assert ready.status_code == 503 and ready.json()["code"] == "engine_faulted"
            stats = engine.stats()
            assert stats["num_running"] == stats["num_waiting"] == 0
            assert stats["num_free_blocks"] == stats["baseline_free_blocks"]  # fail_all freed every block
    finally:
        engine.shutdown()


def check_fault_answer(name: str, r: httpx.Response) -> None:
    """Streamed: a 200 whose last frame is the dialect's error, after some text. Whole: a 500 envelope."""
    if not name.endswith("stream") and "stream_" not in name:
        assert r.status_code == 500, (name, r.status_code, r.text[:300])
        body = r.json()
        if name == "messages":
            assert body["type"] == "error" and body["error"]["type"] == "api_error"
        else:
            assert body["error"]["code"] == "engine_faulted"
        assert "injected device fault" not in json.dumps(body)   # an internal exception's text: the log's only
        assert "engine faulted" in json.dumps(body)
        return
    assert r.status_code == 200, (name, r.text[:300])
    frames = parse_sse(r.text)
    errors = [(e, d) for e, d in frames if e == "error" or (d != "[DONE]" and '"error":{' in d)]
    assert len(errors) == 1, (name, frames[-3:])  # one error, however many choices were open
    assert "injected device fault" not in errors[0][1] and "engine faulted" in errors[0][1]
    if name.startswith("messages"):
        assert frames[-1][0] == "error" and "message_stop" not in [e for e, _ in frames]
    elif name.startswith("responses"):
        assert frames[-1][0] == "error" and not any(e == "response.completed" for e, _ in frames)
    else:
        assert frames[-1] == (None, "[DONE]") and json.loads(frames[-2][1])["error"]["code"] == "engine_faulted"


def test_a_failed_step_fails_only_its_request_over_http(smollm2_loaded, smollm2_gguf_path: Path) -> None:
    """A step's host work that raises for one request (injected with EngineCore.fault_hook) answers that request
    with a 500 engine_step_failed (a stream: its error frame), while the request beside it gets its answer;
    /ready stays 200, /health counts the failure, the pool is back at baseline and the next request is served."""
    engine = real_async_engine(smollm2_loaded, smollm2_gguf_path)
    core = engine.core

    def poison(stage: str, seqs) -> None:
        if stage == "advance" and any(s.params.seed == 4242 for s in seqs):
            raise ValueError("injected fault in one request's host work")

    core.fault_hook = poison
    model = engine.served_name
    user = [{"role": "user", "content": "Write a long story about a lighthouse."}]
    bad = {"model": model, "messages": user, "max_tokens": 20, "seed": 4242}
    good = {"model": model, "messages": user, "max_tokens": 20, "temperature": 0}
    try:
        with app_in_thread(create_app(engine)) as url:
            wait_for(url + "/ready", 200, timeout=30)

            async def go() -> list[httpx.Response]:
                async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                    return list(await asyncio.gather(
                        client.post(CHAT, json=bad), client.post(CHAT, json=good),
                        client.post(CHAT, json={**bad, "stream": True}),
                        client.post("/v1/messages", json={**bad, "max_tokens": 20})))

            failed, ok, streamed, messages = asyncio.run(go())
            assert failed.status_code == 500 and failed.json()["error"]["code"] == "engine_step_failed", failed.text
            assert "injected" not in failed.text
            assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
            frames = [data for _, data in parse_sse(streamed.text)]
            assert streamed.status_code == 200 and frames[-1] == "[DONE]"
            assert json.loads(frames[-2])["error"]["code"] == "engine_step_failed"
            assert messages.status_code == 500 and messages.json()["type"] == "error"
            assert httpx.get(url + "/ready").status_code == 200
            health = httpx.get(url + "/health").json()
            assert health["steps_failed_total"] >= 3 and health["num_free_blocks"] == health["baseline_free_blocks"]
            again = httpx.post(url + CHAT, json=good, timeout=120)
            assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] == \
                ok.json()["choices"][0]["message"]["content"]
    finally:
        core.fault_hook = None
        engine.shutdown()
