"""Agent sessions: a session's last turn keeps its blocks pinned for the next turn, until the next
turn replaces them, a close, the TTL, or the sessions' block cap; and the HTTP side of it."""
from __future__ import annotations

import httpx

from imp_jax.runtime.kv.kv_blocks import BlockTable, KVBlockPool
from imp_jax.runtime.scheduling.sessions import SessionPins
from support.servers import MODEL, LiveServer, live_server, wait_idle  # noqa: F401

BS = 4


def turn(pool: KVBlockPool, tokens: list[int]) -> BlockTable:
    """A request's blocks: allocated, written, committed (as the engine does), not yet freed."""
    table = BlockTable()
    assert pool.allocate(table, tokens, len(tokens))
    pool.commit(table, tokens)
    return table


def end(pool: KVBlockPool, sessions: SessionPins, sid: str | None, table: BlockTable) -> None:
    if sid:
        sessions.keep(sid, table)
    pool.free(table)


def test_a_session_keeps_its_blocks_against_pressure_until_closed() -> None:
    pool = KVBlockPool(num_blocks=9, block_size=BS)
    baseline = pool.num_free_blocks
    sessions = SessionPins(pool, ttl_s=60, max_blocks=4)
    convo = list(range(100, 108))                       # 2 full blocks
    end(pool, sessions, "s1", turn(pool, convo))
    assert sessions.num_blocks == 2 and pool.num_free_blocks == baseline - 2
    end(pool, sessions, None, turn(pool, list(range(200, 224))))   # pressure: 6 blocks, evicts all it can
    again = BlockTable()
    assert pool.allocate(again, convo + [1, 2, 3, 4], 12)
    assert again.num_cached_tokens == 8                 # the session's prefix survived
    pool.free(again)
    assert sessions.close("s1") and not sessions.close("s1")
    assert sessions.num_blocks == 0 and pool.num_free_blocks == baseline


def test_the_next_turn_replaces_the_pins_and_the_ttl_and_cap_release_them() -> None:
    now = [0.0]
    pool = KVBlockPool(num_blocks=17, block_size=BS)
    baseline = pool.num_free_blocks
    sessions = SessionPins(pool, ttl_s=10, max_blocks=5, clock=lambda: now[0])
    first = list(range(100, 108))
    end(pool, sessions, "s1", turn(pool, first))
    end(pool, sessions, "s1", turn(pool, first + list(range(300, 304))))   # turn 2 extends turn 1
    assert sessions.num_blocks == 3 and len(sessions) == 1   # turn 2's three blocks, not 2 + 3
    now[0] = 5.0
    end(pool, sessions, "s2", turn(pool, list(range(400, 412))))   # 3 more: past the cap of 5
    assert "s1" not in sessions and "s2" in sessions and sessions.num_blocks == 3
    now[0] = 14.0
    assert sessions.expire() == 0
    now[0] = 15.0
    assert sessions.expire() == 1 and len(sessions) == 0
    assert pool.num_free_blocks == baseline


def test_session_id_over_http(live_server: LiveServer) -> None:  # noqa: F811
    url = live_server.url
    messages = [{"role": "user", "content": "Name three colors of the rainbow, please, in one short line."}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0, "session_id": "agent-7"}
    first = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert first.status_code == 200, first.text
    stats = wait_idle_with_session(url)
    assert stats["sessions_open"] == 1 and stats["session_pinned_blocks"] > 0
    answer = first.json()["choices"][0]["message"]["content"]
    follow = {**body, "messages": messages + [{"role": "assistant", "content": answer},
                                              {"role": "user", "content": "And two more?"}]}
    second = httpx.post(url + "/v1/chat/completions", json=follow, timeout=60).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    msg = httpx.post(url + "/v1/messages", json={"model": MODEL, "max_tokens": 4, "session_id": "agent-8",
                                                  "messages": [{"role": "user", "content": "Hi there"}]}, timeout=60)
    assert msg.status_code == 200 and wait_idle_with_session(url)["sessions_open"] == 2
    for sid in ("agent-7", "agent-8"):
        closed = httpx.post(url + f"/v1/sessions/{sid}/close", timeout=30)
        assert closed.status_code == 200 and closed.json()["closed"] is True
    gone = httpx.post(url + "/v1/sessions/agent-7/close", timeout=30)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "session_not_found"
    bad = httpx.post(url + "/v1/chat/completions", json={**body, "session_id": ""}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "session_id"
    stats = wait_idle(url)   # every pin released: the pool is back at its baseline
    assert stats["sessions_open"] == 0 and stats["session_pinned_blocks"] == 0


def wait_idle_with_session(url: str) -> dict:
    """/health once nothing runs (the pool is not at baseline: the session holds blocks)."""
    import time
    deadline = time.monotonic() + 60
    while True:
        stats = httpx.get(url + "/health").json()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            return stats
        assert time.monotonic() < deadline
        time.sleep(0.05)
