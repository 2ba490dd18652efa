"""The rows docs/API-AUDIT.md listed as implemented but untested (issue 39, item 6), each asserted here:

- E17: replayed Responses calls join the assistant message before them (a unit test of conversation_of);
- M18-M21: the imp_spec_ngram_* counters read back from /metrics after a request that drafts (SmolLM2);
- M41-M43: imp_queue_waiting / running / depth while requests wait and run (SmolLM2), and 0 after;
- ER10: an unknown anthropic-beta value is logged once per value (the FakeEngine app);
- A5, L3, U3, LB2, LB3 on one tiny random Llama with LoRA slots and --idle-unload-seconds, served
  in-process: /health's idle fields, the admin LoRA routes' 400s, adapter ids across suspend/resume and
  unload/load, and adapters answering the same after an operator and an idle suspend.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.metrics_text import delta, parse, value
from support.servers import MODEL, app_in_thread, fake_server, live_server, wait_for, wait_idle  # noqa: F401
from tiny_models import make_adapter

from imp_jax.server.responses import InputItem, conversation_of
from imp_jax.server.tools import NAMESPACE_SEP


# ------------------------------------------------------------------------------ E17 (unit)
def test_replayed_calls_join_the_assistant_message_before_them() -> None:
    items = [InputItem.model_validate(i) for i in [
        {"role": "user", "content": "weather in Paris and Rome?"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Checking both."}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "weather", "namespace": "geo",
         "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "output_text", "text": "rain"}]},
        {"type": "custom_tool_call", "call_id": "c3", "name": "shell", "input": "ls"},   # no assistant text before
        {"type": "custom_tool_call_output", "call_id": "c3", "output": "a.txt"},
    ]]
    call = lambda cid, name, args: {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
    assert conversation_of(items) == [
        {"role": "user", "content": "weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking both.",   # one response stays one assistant turn
         "tool_calls": [call("c1", "weather", '{"city": "Paris"}'),
                        call("c2", f"geo{NAMESPACE_SEP}weather", '{"city": "Rome"}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "assistant", "content": "", "tool_calls": [call("c3", "shell", json.dumps({"input": "ls"}))]},
        {"role": "tool", "tool_call_id": "c3", "content": "a.txt"},
    ]


# ------------------------------------------------------------------------------ M18-M21 (SmolLM2)
REPEAT = ("Repeat the following text exactly, word for word:\n\nThe lighthouse keeper climbed the spiral stairs every "
          "evening at dusk, counting the steps as his father had taught him. Below, the harbour filled with fishing "
          "boats returning from the grey northern sea.")
SPEC_COUNTERS = ("drafted", "accepted", "emitted", "verify_steps")


@pytest.mark.real_model
def test_spec_ngram_counters_read_back_from_metrics(live_server) -> None:  # noqa: F811
    url = live_server.url
    wait_idle(url)
    before = parse(httpx.get(url + "/metrics", timeout=30).text)
    r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "model": MODEL, "messages": [{"role": "user", "content": REPEAT}], "max_tokens": 40, "temperature": 0,
        "ignore_eos": True, "speculative": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    wait_idle(url)
    after = parse(httpx.get(url + "/metrics", timeout=30).text)
    moved = {k: delta(before, after, f"imp_spec_ngram_{k}_total") for k in SPEC_COUNTERS}
    assert all(moved[k] > 0 for k in SPEC_COUNTERS), moved
    assert moved["accepted"] <= moved["drafted"], moved
    # each verify step emits its accepted drafts plus the token after them
    assert moved["emitted"] == moved["accepted"] + moved["verify_steps"], moved
    assert moved["emitted"] <= usage["completion_tokens"] == 40
    # the request was the only traffic: the series are its usage, and the aggregate agrees with the n-gram one
    details = usage["completion_tokens_details"]
    assert moved == {k: details[f"imp_spec_{k}"] for k in SPEC_COUNTERS}, (moved, details)
    for k in ("drafted", "accepted", "verify_steps"):
        assert delta(before, after, f"imp_spec_{k}_total") == moved[k]


# ------------------------------------------------------------------------------ M41-M43 (SmolLM2)
QUEUE_GAUGES = ("imp_queue_waiting", "imp_queue_running", "imp_queue_depth")
LIVE_MAX_SEQS = 8   # REAL_ENGINE_ARGS --max-num-seqs


@pytest.mark.real_model
def test_queue_gauges_while_requests_wait_and_run(live_server) -> None:  # noqa: F811
    url = live_server.url
    wait_idle(url)
    stop = threading.Event()
    started = threading.Semaphore(0)
    errors: list[str] = []

    def client(i: int) -> None:
        body = {"model": MODEL, "prompt": f"Story {i}: once upon a time", "max_tokens": 300, "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
                if r.status_code != 200:
                    errors.append(f"{r.status_code} {r.read()[:200]!r}")
                    return
                started.release()
                for _ in r.iter_lines():
                    if stop.is_set():
                        return   # leaving cancels the request
        except Exception as e:   # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(LIVE_MAX_SEQS + 4)]
    for t in threads:
        t.start()
    seen: dict[str, float] = {}
    try:
        deadline = time.monotonic() + 120
        while True:
            m = parse(httpx.get(url + "/metrics", timeout=30).text)
            seen = {g: value(m, g) for g in QUEUE_GAUGES}
            if seen["imp_queue_waiting"] >= 1 and seen["imp_queue_running"] >= 1:
                break
            assert not errors, errors
            assert time.monotonic() < deadline, f"never saw requests both waiting and running: {seen}"
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors
    assert seen["imp_queue_running"] <= LIVE_MAX_SEQS
    assert seen["imp_queue_depth"] == seen["imp_queue_waiting"] + seen["imp_queue_running"], seen
    wait_idle(url, timeout=120)
    m = parse(httpx.get(url + "/metrics", timeout=30).text)
    assert {g: value(m, g) for g in QUEUE_GAUGES} == dict.fromkeys(QUEUE_GAUGES, 0.0)


# ------------------------------------------------------------------------------ ER10 (FakeEngine app)
def test_unknown_anthropic_beta_is_logged_once_per_value(fake_server, caplog) -> None:  # noqa: F811
    url, _ = fake_server
    first, second = f"x-beta-{uuid.uuid4().hex[:8]}", f"x-beta-{uuid.uuid4().hex[:8]}"
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    caplog.set_level(logging.INFO, logger="imp_jax.server")
    with httpx.Client(base_url=url, timeout=30) as client:
        for betas in (first, f"{first}, {second}", f"{second} ,{first}", first):
            r = client.post("/v1/messages/count_tokens", json=body, headers={"anthropic-beta": betas})
            assert r.status_code == 200 and r.headers["anthropic-beta"] == betas
    logged = [rec.getMessage() for rec in caplog.records if "anthropic-beta" in rec.getMessage()]
    assert [m for m in logged if first in m] == [f"anthropic-beta {first!r} is not implemented here; ignored"]
    assert len([m for m in logged if second in m]) == 1, logged


# ------------------------------------------------------------------------------ the tiny LoRA server
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IDLE_S = 3.0   # --idle-unload-seconds: long enough that a /health right after a request still sees it awake


@pytest.fixture(scope="module")
def lora_adapters(_tiny_hf_template: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("audit-adapters")
    return {"a": make_adapter(_tiny_hf_template, root / "a", 1, r=4, lora_alpha=8, target_modules=TARGETS),
            "b": make_adapter(_tiny_hf_template, root / "b", 2, r=8, lora_alpha=16,
                              target_modules=["q_proj", "v_proj", "down_proj"])}


@pytest.fixture(scope="module")
def lora_server(_tiny_hf_template: Path, lora_adapters) -> Iterator[tuple[str, Any]]:
    """The tiny Llama (test_lora.py's sizing, so its programs come from the compile cache) with adapter "a"
    loaded at start, two slots, and an idle unload; served in-process."""
    from imp_jax.runtime.core.async_engine import AsyncEngine
    from imp_jax.runtime.config import EngineConfig
    from imp_jax.server.app import create_app
    from imp_jax.server.config import ServerConfig

    config = EngineConfig(model=str(_tiny_hf_template), max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
                          num_kv_blocks=64, lora=[f"a={lora_adapters['a']}"], max_loras=2, max_lora_rank=8,
                          idle_unload_seconds=IDLE_S)
    engine = AsyncEngine(config)
    engine.start()
    try:
        with app_in_thread(create_app(engine, ServerConfig(lora_dir=str(lora_adapters["a"].parent)))) as url:
            wait_for(url + "/ready", 200, timeout=900)
            yield url, engine
    finally:
        engine.shutdown()


def _names(engine: Any) -> dict[str, int]:
    return {a["name"]: a["id"] for a in engine.lora_adapters()}


def _error(r: httpx.Response) -> tuple[int, str, str | None]:
    return r.status_code, r.json()["error"]["code"], r.json()["error"].get("param")


def _answer(c: httpx.Client, engine: Any, lora: str | None) -> list[float]:
    """Greedy logprobs under `lora` (the tiny tokenizer has no text for most ids: logprobs tell answers apart)."""
    r = c.post("/v1/chat/completions", json={
        "model": engine.served_name, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "temperature": 0,
        "repetition_penalty": 1.0, "ignore_eos": True, "logprobs": True, "lora": lora})
    assert r.status_code == 200, r.text
    return [round(t["logprob"], 4) for t in r.json()["choices"][0]["logprobs"]["content"]]


def _wait_idle_suspended(c: httpx.Client) -> dict[str, Any]:
    deadline = time.monotonic() + 120   # idle once the background compiles and first runs are done
    while not (health := c.get("/health").json())["idle_suspended"]:
        assert time.monotonic() < deadline, f"the engine never idled out: {health}"
        time.sleep(0.2)
    return health


@pytest.mark.parametrize("body", [{}, {"name": "x"}, {"path": ""}, {"path": "   "}, {"path": 7},
                                  {"path": ["/a"]}, {"path": None, "name": "x"}], ids=str)
def test_lora_load_without_a_path_is_a_400(lora_server, body) -> None:
    url, engine = lora_server
    before = _names(engine)
    r = httpx.post(url + "/admin/lora/load", json=body, timeout=60)
    assert _error(r) == (400, "invalid_request_error", "path"), r.text
    assert _names(engine) == before


def test_lora_load_with_an_empty_name_is_a_400(lora_server, lora_adapters) -> None:
    url, engine = lora_server
    before = _names(engine)
    for name in ("", "bad\nname", "n" * 1000):
        r = httpx.post(url + "/admin/lora/load", json={"name": name, "path": str(lora_adapters["b"])}, timeout=60)
        assert _error(r) == (400, "invalid_request_error", "name"), (name, r.text)
    assert _names(engine) == before   # the same body with a good name loads (test_lora_ids_...)


@pytest.mark.parametrize("body", [{}, {"id": "1"}, {"id": 1.0}, {"id": True}, {"id": None}, {"name": 5},
                                  {"name": ""}, {"name": ["a"]}, {"id": [1]}], ids=str)
def test_lora_unload_without_an_integer_id_or_a_string_name_is_a_400(lora_server, body) -> None:
    url, engine = lora_server
    before = _names(engine)
    assert before.get("a") == 1   # "1" / 1.0 / True would name it, were they taken as the id
    r = httpx.post(url + "/admin/lora/unload", json=body, timeout=60)
    assert _error(r) == (400, "invalid_request_error", "name"), r.text
    assert _names(engine) == before


def test_lora_ids_stay_across_suspend_and_are_never_reused(lora_server, lora_adapters) -> None:
    url, engine = lora_server
    with httpx.Client(base_url=url, timeout=120) as c:
        id_a = _names(engine)["a"]
        r = c.post("/admin/lora/load", json={"name": "b", "path": str(lora_adapters["b"])})
        assert r.status_code == 200, r.text
        id_b = r.json()["id"]
        seen = {id_a, id_b}
        assert len(seen) == 2
        assert c.post("/admin/suspend").json()["status"] == "suspended"
        assert c.post("/admin/resume").json()["status"] == "resumed"
        assert _names(engine) == {"a": id_a, "b": id_b}
        _wait_idle_suspended(c)
        assert _names(engine) == {"a": id_a, "b": id_b}
        r = c.post("/admin/lora/unload", json={"id": id_b})   # by id: the same adapter after both suspends
        assert r.status_code == 200 and (r.json()["name"], r.json()["id"]) == ("b", id_b), r.text
        for name in ("b", "b", "c"):   # the same name and path again, then another name: a new id each time
            r = c.post("/admin/lora/load", json={"name": name, "path": str(lora_adapters["b"])})
            assert r.status_code == 200, r.text
            assert r.json()["id"] not in seen, (r.json(), seen)
            seen.add(r.json()["id"])
            assert c.post("/admin/lora/unload", json={"name": name}).json()["id"] == r.json()["id"]
        assert _names(engine) == {"a": id_a}


def test_adapters_survive_an_operator_and_an_idle_suspend(lora_server) -> None:
    url, engine = lora_server
    with httpx.Client(base_url=url, timeout=120) as c:
        before = {lora: _answer(c, engine, lora) for lora in ("a", None)}
        assert before["a"] != before[None], "adapter a changes nothing"
        adapters = engine.lora_adapters()
        r = c.post("/admin/suspend")
        assert r.status_code == 200 and r.json()["status"] == "suspended" and r.json()["freed_bytes"] > 0, r.text
        assert c.post("/admin/resume").json()["status"] == "resumed"
        assert engine.lora_adapters() == adapters
        assert {lora: _answer(c, engine, lora) for lora in ("a", None)} == before
        _wait_idle_suspended(c)
        assert engine.lora_adapters() == adapters
        assert _answer(c, engine, "a") == before["a"]   # this request resumed the engine
        assert _answer(c, engine, None) == before[None]


def test_health_shows_the_idle_unload(lora_server) -> None:
    url, engine = lora_server
    with httpx.Client(base_url=url, timeout=120) as c:
        health = _wait_idle_suspended(c)
        assert health["idle_unload_seconds"] == IDLE_S and health["state"] == "ready" and not health["suspended"]
        body = {"model": engine.served_name, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 100,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/chat/completions", json=body) as stream:   # resumes it; asked mid-stream
            assert stream.status_code == 200, stream.read()
            next(line for line in stream.iter_lines() if line.startswith("data: {"))
            health = c.get("/health").json()
        assert health["idle_suspended"] is False and health["idle_unload_seconds"] == IDLE_S
