"""Suspend and resume: the weights and KV cache parked in host memory (device buffers freed) and
back, by the operator (/admin/suspend, sticky) or after --idle-unload-seconds (the next request
resumes transparently); greedy answers are the same after a resume."""
from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import jax
import pytest

from imp_jax.errors import ImpError
from imp_jax.runtime.core.async_engine import AsyncEngine
from imp_jax.runtime.config import EngineConfig
from imp_jax.runtime.request import GenerationRequest, SamplingParams
from support.servers import MODEL, LiveServer, live_server  # noqa: F401


def greedy(prompt: list[int]) -> GenerationRequest:
    return GenerationRequest(uuid.uuid4().hex, prompt, SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, repetition_penalty=1.0))


async def collect(engine: AsyncEngine, req: GenerationRequest) -> list[int]:
    return [t async for ev in engine.generate(req) for t in ev.token_ids]


def live_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


@pytest.fixture
def tiny_engine(tiny_hf_dir):
    def make(**kw) -> AsyncEngine:
        config = EngineConfig(model=str(tiny_hf_dir), max_model_len=128, max_num_seqs=4,
                              max_num_batched_tokens=32, num_kv_blocks=32, **kw)
        engine = AsyncEngine(config)
        engine.start()
        made.append(engine)
        return engine

    made: list[AsyncEngine] = []
    yield make
    for engine in made:
        engine.shutdown()


def test_operator_suspend_frees_device_memory_and_resume_answers_the_same(tiny_engine) -> None:
    engine = tiny_engine()

    async def main() -> None:
        await engine.wait_ready()
        before = await collect(engine, greedy([5, 17, 33, 2, 9]))
        held = live_bytes()
        parked = engine.core.step_fn
        weights_and_kv = sum(a.nbytes for a in [*parked._leaves, *parked.kv])
        answer = await engine.suspend()
        assert answer["status"] == "suspended" and answer["freed_bytes"] == weights_and_kv > 0
        assert held - live_bytes() >= weights_and_kv   # the device buffers are gone, not just unreferenced
        assert engine.stats()["suspended"] is True and engine.state == "suspended"
        with pytest.raises(ImpError) as refused:
            await collect(engine, greedy([1, 2, 3]))
        assert refused.value.status == 503 and refused.value.code == "suspended"
        assert (await engine.suspend())["status"] == "already_suspended"
        assert (await engine.resume())["status"] == "resumed"
        assert (await engine.resume())["status"] == "not_suspended"
        assert await collect(engine, greedy([5, 17, 33, 2, 9])) == before
        stats = engine.stats()
        assert stats["num_free_blocks"] == stats["baseline_free_blocks"] and stats["compilations_after_warmup"] == 0

    asyncio.run(main())


def test_idle_unload_parks_and_the_next_request_resumes_it(tiny_engine) -> None:
    engine = tiny_engine(idle_unload_seconds=0.5)

    async def main() -> None:
        await engine.wait_ready()
        before = await collect(engine, greedy([7, 7, 1, 4]))
        deadline = time.monotonic() + 60
        while not engine.idle_suspended:   # idle once the background compiles and first runs are done
            assert time.monotonic() < deadline, "the engine never idled out"
            await asyncio.sleep(0.1)
        assert engine.state == "ready" and engine.core.step_fn.suspended
        assert engine.stats()["idle_suspended"] is True
        assert await collect(engine, greedy([7, 7, 1, 4])) == before   # resumed inside the request

    asyncio.run(main())


def test_admin_suspend_and_resume_over_http(live_server: LiveServer) -> None:  # noqa: F811
    url = live_server.url
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
            "repetition_penalty": 1.0}
    before = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    r = httpx.post(url + "/admin/suspend", timeout=60)
    assert r.status_code == 200 and r.json()["status"] == "suspended" and r.json()["freed_bytes"] > 0
    try:
        ready = httpx.get(url + "/ready")
        assert ready.status_code == 503 and ready.json()["code"] == "suspended"
        health = httpx.get(url + "/health")
        assert health.status_code == 200 and health.json()["suspended"] is True
        refused = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "suspended"
        msg = httpx.post(url + "/v1/messages", json={"model": MODEL, "max_tokens": 4,
                                                      "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
        assert msg.status_code == 503 and msg.json()["error"]["type"] == "overloaded_error"
        for route in ("/admin/lora/load", "/admin/lora/unload"):   # imp answers 409 here, not 503
            lora = httpx.post(url + route, json={"name": "x", "path": "/x"}, timeout=60)
            assert (lora.status_code, lora.json()["error"]["code"]) == (409, "suspended")
    finally:
        resumed = httpx.post(url + "/admin/resume", timeout=60)
    assert resumed.status_code == 200 and resumed.json()["status"] == "resumed"
    again = httpx.post(url + "/admin/resume", timeout=60)
    assert again.status_code == 409 and again.json()["error"]["code"] == "not_suspended"
    assert httpx.get(url + "/ready").status_code == 200
    after = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert after == before
