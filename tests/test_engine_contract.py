"""The server-engine contract (runtime/api.py), on the real AsyncEngine, FakeEngine and EngineReplicas over
fakes alike: the protocol surface, the events per token, finish reasons, usage, cancel, suspend, and errors
as ImpError with codes. Then a real engine fault over HTTP.

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
from support.servers import (FAULT_MARKER, FakeEngine, app_in_thread, check_event_contract, fake_tokenizer,
                             parse_sse, protocol_members, wait_for)

from imp_jax.errors import EngineError, ImpError, InvalidRequestError
from imp_jax.kernels_pallas import kv_storage_dtype
from imp_jax.runtime.api import ENGINE_STATES, Capabilities, Engine
from imp_jax.runtime.core.async_engine import AsyncEngine
from imp_jax.runtime.core.builder import enable_compilation_cache
from imp_jax.runtime.config import EngineConfig
from imp_jax.runtime.core.engine import EngineCore
from imp_jax.runtime.core.replicas import EngineReplicas
from imp_jax.runtime.request import EngineEvent, GenerationRequest, SamplingParams
from imp_jax.runtime.parallel.sharding import default_mesh
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


def ready_fake() -> FakeEngine:
    fake = FakeEngine(fake_tokenizer())
    fake.state = "ready"
    return fake


@pytest.fixture(params=("real", "fake", "fake_replicas"))
def engine(request: pytest.FixtureRequest) -> Engine:
    """Each engine the server may hold: the real AsyncEngine, FakeEngine, and EngineReplicas over fakes."""
    if request.param == "real":
        return request.getfixturevalue("real_engine")
    if request.param == "fake":
        return ready_fake()
    tok = fake_tokenizer()
    router = EngineReplicas(EngineConfig(data_parallel_size=2), build=lambda i: FakeEngine(tok))
    for replica in router.replicas:
        replica.state = "ready"
    return router


def at_baseline(engine: Engine) -> bool:
    """Nothing runs and every KV block is free again."""
    stats = engine.stats()
    return stats["num_free_blocks"] == stats["baseline_free_blocks"] and stats["num_running"] == 0


CASES = {
    "one": dict(max_tokens=5, ignore_eos=True),
    "n3": dict(n=3, max_tokens=4, temperature=1.0, seed=3, ignore_eos=True),
    "greedy_may_stop": dict(max_tokens=12, temperature=0.0),
}


def test_every_engine_keeps_the_protocol_surface(engine: Engine) -> None:
    assert Engine in type(engine).__mro__ and not type(engine).__abstractmethods__
    missing = {name for name in protocol_members(Engine) if not hasattr(engine, name)}
    assert not missing, f"{type(engine).__name__} lacks {sorted(missing)}"
    assert engine.state == "ready" and engine.state in ENGINE_STATES and engine.error is None
    caps = engine.capabilities
    assert isinstance(caps, Capabilities)
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps.lora = True  # type: ignore[misc]
    assert isinstance(engine.served_name, str) and engine.served_name
    assert isinstance(engine.max_model_len, int) and engine.max_model_len > 0
    assert isinstance(engine.max_num_seqs, int) and engine.max_num_seqs > 0
    assert engine.tokenizer.decode(engine.tokenizer.encode("hello", add_special_tokens=False)) == "hello"
    assert engine.vocab_size > 0 and engine.default_params is not None
    assert isinstance(engine.dtype, str) and engine.device == "cpu"
    assert {"num_running", "num_waiting", "num_free_blocks", "baseline_free_blocks"} <= set(engine.stats())
    assert engine.replica_states() == ["ready"] * (2 if caps.replicas else 1)
    assert not caps.lora and engine.lora_adapters() == []   # no engine here has LoRA slots
    with pytest.raises(ImpError) as refused:   # a capability it lacks: a 400, not an AttributeError
        asyncio.run(engine.load_lora("a", "/nowhere"))
    assert refused.value.status == 400


@pytest.mark.parametrize("case", list(CASES))
def test_events_per_token_finish_reasons_and_usage(engine: Engine, case: str) -> None:
    req = request(engine, "The capital of France is", **CASES[case])
    check_event_contract(asyncio.run(events_of(engine, req)), req, engine.tokenizer)
    assert at_baseline(engine)


def test_cancel_ends_every_open_choice_cancelled_with_usage(engine: Engine) -> None:
    req = request(engine, "Tell me a story", n=2, max_tokens=200, temperature=1.0, seed=1, ignore_eos=True)

    async def run() -> list[EngineEvent]:
        events = []
        async for ev in engine.generate(req):
            events.append(ev)
            if len(events) == 1:
                engine.cancel(req.request_id)
        return events

    events = asyncio.run(run())
    check_event_contract(events, req, engine.tokenizer, ending="cancelled")
    assert sum(len(ev.token_ids) for ev in events) < 2 * 200
    assert at_baseline(engine)
    engine.cancel(req.request_id)   # an id no longer running: a no-op


def test_bad_input_is_an_imp_error_with_a_code_before_any_event(engine: Engine) -> None:
    too_long = GenerationRequest(f"contract-{next(_ids)}", [1] * engine.max_model_len, SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError) as err:
        asyncio.run(events_of(engine, too_long))
    assert (err.value.code, err.value.param, err.value.status) == ("context_length_exceeded", "prompt", 400)
    with pytest.raises(InvalidRequestError) as err:
        asyncio.run(events_of(engine, request(engine, "hi", temperature=-1.0, max_tokens=2)))
    assert (err.value.param, err.value.status) == ("temperature", 400)
    assert at_baseline(engine)


@pytest.mark.parametrize("engine", ["fake", "fake_replicas"], indirect=True)
def test_a_suspended_engine_refuses_with_503_suspended_until_resumed(engine: Engine) -> None:
    """Not on `real_engine`: parking moves the session's shared SmolLM2 weights off the device (the next
    engine built on them would find them deleted); test_suspend.py suspends real engines of its own."""
    assert engine.capabilities.suspend

    async def run() -> None:
        assert (await engine.suspend())["status"] == "suspended"
        with pytest.raises(EngineError) as err:
            await events_of(engine, request(engine, "hi", max_tokens=2))
        assert (err.value.code, err.value.status) == ("suspended", 503)
        assert (await engine.resume())["status"] == "resumed"
        assert (await engine.resume())["status"] == "not_suspended"
        assert (await events_of(engine, request(engine, "hi", max_tokens=2, ignore_eos=True)))[-1].done

    asyncio.run(run())
    assert engine.state == "ready"


def test_fake_fault_is_the_real_fault_contract() -> None:
    fake = ready_fake()
    req = request(fake, f"please {FAULT_MARKER}", n=2, max_tokens=8)
    events = asyncio.run(events_of(fake, req))
    check_event_contract(events, req, fake.tokenizer, ending="error")
    assert [ev.index for ev in events if ev.finish_reason] == [0, 1]


def test_fake_refuses_what_only_the_real_engine_does() -> None:
    fake = ready_fake()
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
