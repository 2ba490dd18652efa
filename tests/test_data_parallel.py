"""Data parallelism (--data-parallel-size): the router's choices, the stats it sums, and a real DP=2 server.

The router tests give EngineReplicas replicas that hold a real KVBlockPool and answer only what routing
reads (state, prefix_key, holds_block, stats); generation itself is tested on the real server below,
which runs on two fake CPU devices (XLA_FLAGS must be set before jax starts: a subprocess).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from support.metrics_text import parse
from support.servers import (MODEL, READY_TIMEOUT_S, REAL_ENGINE_ARGS, FakeEngine, LiveServer, app_in_thread,
                             fake_tokenizer, live_server, wait_for)  # noqa: F401

from imp_jax.errors import ImpError
from imp_jax.runtime.config import EngineConfig
from imp_jax.runtime.kv.kv_blocks import BlockTable, KVBlockPool
from imp_jax.runtime.core.replicas import EngineReplicas, check_devices
from imp_jax.runtime.request import GenerationRequest, SamplingParams

BLOCK = 4
IDS = itertools.count()


class PoolReplica:
    """What the router reads of an AsyncEngine, over a real block pool (no model: nothing generates)."""

    def __init__(self, stats: dict[str, Any] | None = None):
        self.state = "ready"
        self.error = None
        self.progress = 1.0
        self.idle_suspended = False
        self.pool = KVBlockPool(64, BLOCK)
        self._stats = stats or {}

    def prefix_key(self, req: GenerationRequest) -> Any:
        return req.cache_salt

    def holds_block(self, block_hash: bytes) -> bool:
        return self.pool.holds(block_hash)

    def cache(self, ids: list[int], salt: str | None = None) -> None:
        """Leave `ids`' full blocks cached idle, as a finished request does."""
        table = BlockTable()
        assert self.pool.allocate(table, ids, len(ids), salt)
        self.pool.commit(table, ids, salt)
        self.pool.free(table)

    def stats(self) -> dict[str, Any]:
        return {"state": self.state, **self._stats}


def replicas(n: int = 2, **config: Any) -> EngineReplicas:
    return EngineReplicas(EngineConfig(data_parallel_size=n, block_size=BLOCK, **config), build=lambda i: PoolReplica())


def req(ids: list[int], session: str | None = None, salt: str | None = None) -> GenerationRequest:
    return GenerationRequest(request_id=f"r{next(IDS)}", prompt_ids=ids, params=SamplingParams(max_tokens=1),
                             session_id=session, cache_salt=salt)


SYSTEM = list(range(100, 124))   # six full blocks


def test_the_replica_holding_the_longest_prefix_gets_the_request() -> None:
    router = replicas(3)
    router.replicas[0].cache(SYSTEM[:8])             # two blocks
    router.replicas[2].cache(SYSTEM + [1, 2, 3, 4])   # all six
    for _ in range(3):   # not a tie broken by turn: always the longest
        assert router.route(req(SYSTEM + [9, 9, 9])) == 2
    assert router.route(req(SYSTEM[:8] + [7] * 9)) in (0, 2)   # both hold the two blocks it shares
    assert router.cached_blocks(req(SYSTEM + [5]), [0, 1, 2]) == {0: 2, 1: 0, 2: 6}


def test_a_prefix_cached_under_another_salt_is_no_affinity() -> None:
    router = replicas(2)
    router.replicas[1].cache(SYSTEM, salt="key:a")
    assert router.cached_blocks(req(SYSTEM + [1], salt="key:b"), [0, 1]) == {0: 0, 1: 0}
    assert router.cached_blocks(req(SYSTEM + [1], salt="key:a"), [0, 1]) == {0: 0, 1: 6}


def test_without_affinity_the_least_loaded_replica_wins_and_ties_rotate() -> None:
    router = replicas(2)
    assert {router.route(req([1, 2])) for _ in range(4)} == {0, 1}   # idle and equal: both get work
    router._loads[0].rows = 3
    assert [router.route(req([1, 2])) for _ in range(3)] == [1, 1, 1]
    router._loads[1].rows = 3
    router._loads[1].pending_tokens = 2 * router.config.max_num_batched_tokens   # two steps of prefill queued
    assert router.route(req([1, 2])) == 0


def test_affinity_yields_to_load_past_a_quarter_batch() -> None:
    router = replicas(2, max_num_seqs=8)   # slack: 2 rows
    router.replicas[0].cache(SYSTEM)
    router._loads[0].rows = 2
    assert router.route(req(SYSTEM + [1])) == 0   # within the slack: the cache is worth it
    router._loads[0].rows = 3
    assert router.route(req(SYSTEM + [1])) == 1


def test_a_session_sticks_to_its_first_replica() -> None:
    router = replicas(2)
    first = router.route(req([5, 6], session="s1"))
    router._loads[first].rows = 10   # busier now, and nothing cached: a new request would go elsewhere
    assert router.route(req([7, 8])) != first
    assert all(router.route(req([9], session="s1")) == first for _ in range(3))


def test_a_faulted_replica_gets_no_request_and_makes_the_state_faulted() -> None:
    router = replicas(2)
    router.replicas[1].state, router.replicas[1].error = "faulted", "device fault: boom"
    assert {router.route(req([1, 2])) for _ in range(4)} == {0}
    assert router.state == "faulted" and router.error == "replica 1: device fault: boom"
    router.replicas[1].state = "warming_up"
    assert router.state == "warming_up"


def test_stats_sum_the_replicas_and_keep_each() -> None:
    one = {"num_running": 1, "num_waiting": 2, "kv_blocks_total": 10, "kv_block_size": 16, "decode_batch_max": 3}
    two = {"num_running": 0, "num_waiting": 5, "kv_blocks_total": 10, "kv_block_size": 16, "decode_batch_max": 7}
    router = EngineReplicas(EngineConfig(data_parallel_size=2), build=lambda i: PoolReplica([one, two][i]))
    stats = router.stats()
    assert (stats["num_running"], stats["num_waiting"], stats["kv_blocks_total"]) == (1, 7, 20)
    assert (stats["kv_block_size"], stats["decode_batch_max"]) == (16, 7)
    assert [r["replica"] for r in stats["replicas"]] == [0, 1]
    assert stats["replicas"][1]["num_waiting"] == 5 and stats["data_parallel_size"] == 2
    assert router.max_num_seqs == 2 * router.config.max_num_seqs   # /props total_slots, /info
    router.replicas[1]._stats = {}   # still loading: it has no counters yet
    assert router.stats()["num_waiting"] == 2 and router.stats()["state"] == "ready"


def test_the_server_over_replicas_routes_reports_each_and_refuses_when_one_faults() -> None:
    """The app's wiring over EngineReplicas (FakeEngine replicas: the AsyncEngine's interface, no model)."""
    from imp_jax.server.app import create_app

    tok = fake_tokenizer()
    router = EngineReplicas(EngineConfig(data_parallel_size=2), build=lambda i: FakeEngine(tok))
    router.start()
    body = {"model": "fake-model", "prompt": "hello", "max_tokens": 3}
    with app_in_thread(create_app(router)) as url:
        wait_for(url + "/ready", 200, timeout=30)
        assert httpx.get(url + "/ready").json()["replica_states"] == ["ready", "ready"]
        for _ in range(4):
            assert httpx.post(url + "/v1/completions", json=body).status_code == 200
        replicas = httpx.get(url + "/health").json()["replicas"]
        assert [r["requests_routed"] for r in replicas] == [2, 2] and [r["routed_rows"] for r in replicas] == [0, 0]
        assert httpx.get(url + "/props").json()["total_slots"] == 2 * router.config.max_num_seqs
        series = parse(httpx.get(url + "/metrics").text)
        assert series[("imp_replica_ready", (("replica", "1"),))] == 1
        router.replicas[1].state = "faulted"
        ready = httpx.get(url + "/ready")
        assert ready.status_code == 503 and ready.json()["code"] == "engine_faulted"
        assert ready.json()["replica_states"] == ["ready", "faulted"]
        r = httpx.post(url + "/v1/completions", json=body)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_faulted"
        assert httpx.get(url + "/health").status_code == 503
        assert parse(httpx.get(url + "/metrics").text)[("imp_replica_ready", (("replica", "1"),))] == 0


def test_too_few_devices_is_a_start_up_error_that_says_how_to_get_fake_ones() -> None:
    """This process has one CPU device (the live servers below get theirs through XLA_FLAGS); the
    server prints this message and exits 2 (server/__main__.py)."""
    with pytest.raises(ValueError) as err:
        check_devices(EngineConfig(data_parallel_size=3))
    assert "--data-parallel-size 3 needs 3 devices; this host has 1 cpu device(s)" in str(err.value)
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=3" in str(err.value)
    with pytest.raises(ValueError) as err:   # each replica takes a group of --tensor-parallel-size devices
        check_devices(EngineConfig(data_parallel_size=2, tensor_parallel_size=2))
    assert "--data-parallel-size 2 x --tensor-parallel-size 2 needs 4 devices" in str(err.value)
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 needs 2 devices"):
        check_devices(EngineConfig(tensor_parallel_size=2))


def test_a_data_parallel_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="--data-parallel-size must be >= 1"):
        EngineConfig(data_parallel_size=0)


# --------------------------------------------------------------------------- a real DP=2 server
@pytest.fixture(scope="module")
def dp_server(smollm2_gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """SmolLM2 with two replicas on two fake CPU devices (the shared server's sizing, so its programs are
    the ones the persistent compilation cache holds); SIGTERM must end it with 0."""
    import os
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    server = LiveServer([*REAL_ENGINE_ARGS, "--model", MODEL, "--data-parallel-size", "2"],
                        tmp_path_factory.mktemp("dp") / "server.log", env={"XLA_FLAGS": flags})
    try:
        wait_for(server.url + "/ready", 200, timeout=READY_TIMEOUT_S, proc=server.proc)
    except Exception:
        server.stop()
        raise AssertionError(f"the DP=2 server did not start:\n{server.log_text()[-3000:]}")
    yield server
    assert server.stop() == 0, server.log_text()[-3000:]


def routed(url: str) -> list[float]:
    """Requests each replica admitted so far (imp_replica_requests_total)."""
    series = parse(httpx.get(url + "/metrics").text)
    return [series[("imp_replica_requests_total", (("replica", str(i)),))] for i in range(2)]


def complete(url: str, prompt: str, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_dp2_replicas_sit_on_their_own_devices_and_report_ready(dp_server: LiveServer) -> None:
    ready = httpx.get(dp_server.url + "/ready").json()
    assert ready["ready"] and ready["replica_states"] == ["ready", "ready"]
    health = httpx.get(dp_server.url + "/health").json()
    assert [r["device"] for r in health["replicas"]] == ["cpu:0", "cpu:1"]
    assert health["kv_blocks_total"] == sum(r["kv_blocks_total"] for r in health["replicas"])


def test_dp2_both_replicas_serve_and_answer_as_one_replica_does(dp_server: LiveServer, live_server: LiveServer) -> None:
    prompts = ["Name a color:", "Count to three:", "The capital of France is"]
    before = routed(dp_server.url)
    for prompt in prompts:   # one block or less each: no affinity, so the idle replicas take turns
        got = complete(dp_server.url, prompt)["choices"][0]["text"]
        assert got == complete(live_server.url, prompt)["choices"][0]["text"], prompt
    after = routed(dp_server.url)
    assert all(a > b for a, b in zip(after, before)), (before, after)
    assert sum(after) - sum(before) == len(prompts)


SYSTEM_PROMPT = ("You are a careful assistant for a small bakery. You answer questions about bread, opening "
                 "hours, prices and allergens. Keep every answer short and friendly, never invent prices, and "
                 "say when you do not know something. The bakery opens at seven and closes at six, every day "
                 "but Sunday. ") * 2


def test_dp2_the_same_long_system_prompt_returns_to_the_replica_that_cached_it(dp_server: LiveServer) -> None:
    def chat(question: str) -> tuple[int, int]:
        before = routed(dp_server.url)
        body = {"model": MODEL, "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]}
        r = httpx.post(dp_server.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        moved = [a - b for a, b in zip(routed(dp_server.url), before)]
        assert sorted(moved) == [0, 1], moved
        return moved.index(1), r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    home, _ = chat("When do you open?")
    for question in ("Do you sell rye bread?", "Is there anything without nuts?"):
        complete(dp_server.url, "Hi")   # turns the tie-break to the other replica: affinity must win anyway
        replica, cached = chat(question)
        assert replica == home and cached >= 64, (replica, home, cached)


def test_dp2_pools_return_to_baseline_after_a_cancelled_stream_and_a_session(dp_server: LiveServer) -> None:
    url = dp_server.url
    body = {"model": MODEL, "prompt": "Write a long story about a dragon.", "max_tokens": 300,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 3:
                break   # the client leaves mid-stream
    turn = {"model": MODEL, "max_tokens": 4, "temperature": 0, "session_id": "dp-session",
            "messages": [{"role": "user", "content": "Remember the number 7. " * 8}]}
    homes = []
    for _ in range(2):
        before = routed(url)
        assert httpx.post(url + "/v1/chat/completions", json=turn, timeout=120).status_code == 200
        homes.append([a - b for a, b in zip(routed(url), before)].index(1))
    assert homes[0] == homes[1]
    pinned = httpx.get(url + "/health").json()["replicas"][homes[0]]
    assert pinned["sessions_open"] == 1 and pinned["session_pinned_blocks"] > 0
    assert httpx.post(url + "/v1/sessions/dp-session/close").status_code == 200
    deadline = time.monotonic() + 60
    while True:
        health = httpx.get(url + "/health").json()
        idle = [r["num_free_blocks"] == r["baseline_free_blocks"] and r["num_running"] + r["num_waiting"] == 0
                and r["routed_rows"] == 0 and r["sessions_open"] == 0 for r in health["replicas"]]
        if all(idle):
            break
        assert time.monotonic() < deadline, json.dumps(health["replicas"])
        time.sleep(0.1)
    series = parse(httpx.get(url + "/metrics").text)
    assert series[("imp_kv_blocks_used", ())] == 0
    assert [series[("imp_replica_kv_blocks_used", (("replica", str(i)),))] for i in range(2)] == [0, 0]
    assert series[("imp_compilations_after_warmup_total", ())] == 0


class AdapterReplica(PoolReplica):
    """A replica that loads and unloads adapters by name; `busy` ones time out, as AsyncEngine.unload_lora does."""

    def __init__(self, busy: bool):
        super().__init__()
        self.busy = busy
        self.adapters: dict[str, str] = {"a": "/adapters/a"}
        self.timeouts: list[float | None] = []

    async def load_lora(self, name: str, path: str) -> dict[str, Any]:
        self.adapters[name] = path
        return {"name": name, "path": path}

    async def unload_lora(self, name: str, timeout_s: float | None = None) -> dict[str, Any] | None:
        self.timeouts.append(timeout_s)
        if self.busy:
            raise ImpError("still used", code="lora_unload_timeout", status=503, param="timeout_s")
        return {"name": name, "path": self.adapters.pop(name), "unloaded": True}


def test_a_lora_unload_one_replica_refuses_leaves_the_adapter_on_every_replica() -> None:
    idle, busy = AdapterReplica(busy=False), AdapterReplica(busy=True)
    router = EngineReplicas(EngineConfig(data_parallel_size=2), build=lambda i: [idle, busy][i])
    with pytest.raises(ImpError) as err:
        asyncio.run(router.unload_lora("a", 0.5))
    assert err.value.code == "lora_unload_timeout"
    assert idle.timeouts == busy.timeouts == [0.5]                     # the body's timeout_s reaches each replica
    assert idle.adapters == busy.adapters == {"a": "/adapters/a"}      # loaded again where it had gone
    busy.busy = False
    assert asyncio.run(router.unload_lora("a", 5)) == {"name": "a", "path": "/adapters/a", "unloaded": True}
    assert idle.adapters == busy.adapters == {}
