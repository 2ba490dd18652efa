"""Fairness between callers on the server: per-key limits (tenants.py), failed-key throttling per address
(auth_throttle.py) and the encoders' own queue caps (admission.py). The limits are server bookkeeping, so
the apps here run over FakeEngine and a held fake encoder (support/servers.py says why a fake is used)."""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest
from support.servers import FakeEngine, app_in_thread, fake_tokenizer, wait_for

from imp_jax.server.admission import ENCODER_NAMES, AdmissionGate
from imp_jax.server.app import create_app
from imp_jax.server.auth_throttle import AuthThrottle
from imp_jax.server.config import ServerConfig
from imp_jax.server.context import state_of
from imp_jax.server.encoders import install_encoders
from imp_jax.server.errors import Refusal
from imp_jax.server.tenants import TenantLimits

A, B = {"Authorization": "Bearer key-a"}, {"x-api-key": "key-b"}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
MESSAGES = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _refusal(fn: Any, *args: Any) -> Refusal:
    with pytest.raises(Refusal) as info:
        fn(*args)
    return info.value


# --------------------------------------------------------------------------- the bookkeeping alone
def test_tenant_limits_count_in_flight_and_queued_per_tenant() -> None:
    limits = TenantLimits(max_concurrent=2, max_queued=1)
    first = limits.admit("a", 5)
    assert _refusal(limits.admit, "a", 5).code == "key_queue_full"   # a's first has no event yet
    limits.admit("b", 5)   # another tenant is not counted against a
    first.started()
    second = limits.admit("a", 5)
    second.started()
    r = _refusal(limits.admit, "a", 5)
    assert (r.status, r.code, r.headers["Retry-After"]) == (429, "concurrency_limit_exceeded", "1")
    first.end(10)
    first.end(10)   # idempotent
    limits.admit("a", 5)


def test_tokens_per_minute_charge_prompt_then_output_and_refill() -> None:
    clock = Clock()
    limits = TenantLimits(tokens_per_minute=600, clock=clock)   # 10 tokens a second
    hold = limits.admit("a", 500)
    limits.admit("a", 50).end(0)   # 50 left before: still positive, let in
    hold.end(200)                  # the output is charged at the end: 600 - 750 = -150 in debt
    r = _refusal(limits.admit, "a", 1)
    assert (r.status, r.code, r.headers["Retry-After"]) == (429, "tokens_per_minute_exceeded", "16")
    limits.admit("b", 1)
    clock.now = 15.2   # -150 + 152 > 0
    limits.admit("a", 1)


def test_auth_throttle_counts_failed_keys_per_address_for_a_minute() -> None:
    clock = Clock()
    throttle = AuthThrottle(3, clock=clock)
    for _ in range(3):
        throttle.check("1.2.3.4", failed=True)
    throttle.check("5.6.7.8", failed=True)   # another address has its own minute
    clock.now = 10.0
    r = _refusal(throttle.check, "1.2.3.4", False)   # a valid key too: the 429 must not tell them apart
    assert (r.status, r.code, r.headers["Retry-After"]) == (429, "auth_failures_exceeded", "50")
    clock.now = 60.5
    throttle.check("1.2.3.4", failed=False)


def test_the_encoder_gate_counts_inputs_and_lets_a_large_request_in_alone() -> None:
    gate = AdmissionGate(4, 0, ENCODER_NAMES)
    big = gate.admit(100, items=10)   # nothing queued: taken, or it could never run
    r = _refusal(gate.admit, 1, 1)
    assert (r.code, r.headers["Retry-After"]) == ("queue_full", "1")
    assert "--max-queued-embedding-inputs 4" in str(r)
    big.release()
    three = gate.admit(30, items=3)
    gate.admit(10, items=1)
    assert _refusal(gate.admit, 10, 1).code == "queue_full"
    three.release()
    gate.admit(10, items=2)


# --------------------------------------------------------------------------- on the wire
@pytest.fixture(scope="module")
def limited() -> Iterator[str]:
    """Three keys, one request in flight per key, a small token budget per key."""
    engine = FakeEngine(fake_tokenizer(), token_delay=0.01)
    engine.start()
    config = ServerConfig(api_key=["key-a", "key-b", "key-c"], max_concurrent_per_key=1, tokens_per_minute=40)
    with app_in_thread(create_app(engine, config)) as url:
        wait_for(url + "/ready", 200, timeout=30)
        yield url


def _is_429(r: httpx.Response, code: str, anthropic: bool = False) -> bool:
    body = r.json()
    if anthropic:
        return r.status_code == 429 and body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
    ok = body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == code
    return r.status_code == 429 and ok and int(r.headers["Retry-After"]) >= 1


def _read_a_token(stream: httpx.Response) -> Iterator[str]:
    """Past the role chunk (sent before the request is admitted) to a generated token; the lines left, to
    keep while the request should stay in flight (dropping the iterator closes the stream)."""
    lines = stream.iter_lines()
    chunks = (line for line in lines if line.startswith("data:"))
    next(chunks)
    assert '"content":"' in next(chunks)
    return lines


def test_a_key_with_a_request_in_flight_gets_429_and_another_key_does_not(limited: str) -> None:
    long = {**CHAT, "max_tokens": 200, "stream": True}   # ~2 s of tokens
    with httpx.stream("POST", limited + "/v1/chat/completions", json=long, headers=A, timeout=30) as stream:
        lines = _read_a_token(stream)
        again = httpx.post(limited + "/v1/chat/completions", json=CHAT, headers=A, timeout=30)
        assert _is_429(again, "concurrency_limit_exceeded")
        messages = httpx.post(limited + "/v1/messages", json=MESSAGES, headers=A, timeout=30)
        assert _is_429(messages, "concurrency_limit_exceeded", anthropic=True)
        assert httpx.post(limited + "/v1/chat/completions", json=CHAT, headers=B, timeout=30).status_code == 200
        assert next(lines) is not None   # still streaming


def test_a_key_past_its_tokens_per_minute_gets_429_with_retry_after(limited: str) -> None:
    key = {"x-api-key": "key-c"}
    first = httpx.post(limited + "/v1/chat/completions", json={**CHAT, "max_tokens": 45}, headers=key, timeout=30)
    assert first.status_code == 200   # the bucket was full: prompt and 45 tokens put it in debt
    r = httpx.post(limited + "/v1/chat/completions", json=CHAT, headers=key, timeout=30)
    assert _is_429(r, "tokens_per_minute_exceeded") and int(r.headers["Retry-After"]) >= 5


def test_an_address_past_its_failed_keys_gets_429_before_its_key_is_checked() -> None:
    engine = FakeEngine(fake_tokenizer())
    engine.start()
    config = ServerConfig(api_key=["key-a"], auth_failures_per_minute=3)
    with app_in_thread(create_app(engine, config)) as url:   # its own app: loopback stays locked a minute
        bad = {"Authorization": "Bearer guess"}
        assert httpx.get(url + "/v1/models").status_code == 401   # no key: not a guess
        codes = [httpx.get(url + "/v1/models", headers=bad).status_code for _ in range(4)]
        assert codes == [401, 401, 401, 429]
        r = httpx.get(url + "/v1/models", headers=A)   # a right guess now would look the same
        assert _is_429(r, "auth_failures_exceeded")
        assert httpx.get(url + "/health").status_code == 200


def test_without_keys_the_client_address_is_the_tenant() -> None:
    engine = FakeEngine(fake_tokenizer(), token_delay=0.01)
    engine.start()
    with app_in_thread(create_app(engine, ServerConfig(max_concurrent_per_key=1))) as url:
        wait_for(url + "/ready", 200, timeout=30)
        long = {**CHAT, "max_tokens": 200, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=long, timeout=30) as stream:
            lines = _read_a_token(stream)
            assert _is_429(httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=30),
                           "concurrency_limit_exceeded")
            assert next(lines) is not None
        assert httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200


class HeldEncoder:
    """An embedding model that answers only once `release` is set: requests stay queued meanwhile."""

    served_name, task, state, error = "fake-embed", "embed", "ready", None
    max_model_len, vocab_size, dimensions, normalize, tokenizer, in_flight = 64, 100, 4, True, None, 0

    def __init__(self) -> None:
        self.release = threading.Event()

    def start(self) -> None:
        pass

    async def wait_ready(self) -> None:
        pass

    def shutdown(self, timeout: float = 10.0) -> None:
        self.release.set()

    def stats(self) -> dict[str, Any]:
        return {}

    async def run(self, items: list[Any]) -> np.ndarray:
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        return np.ones((len(items), self.dimensions), np.float32)


@contextlib.contextmanager
def encoder_app(config: ServerConfig) -> Iterator[tuple[str, Any, HeldEncoder]]:
    """A FakeEngine app with a HeldEncoder beside it, served on loopback: (url, app, encoder)."""
    chat, encoder = FakeEngine(fake_tokenizer()), HeldEncoder()
    chat.start()
    app = create_app(chat, config)
    install_encoders(app, [encoder])
    with app_in_thread(app) as url:
        wait_for(url + "/ready", 200, timeout=30)
        yield url, app, encoder


def test_embeddings_wait_within_their_own_input_cap() -> None:
    with encoder_app(ServerConfig(max_queued_embedding_inputs=4)) as (url, app, encoder), ThreadPoolExecutor(2) as pool:

        def embed(n: int) -> httpx.Response:
            return httpx.post(url + "/v1/embeddings", json={"input": [[1, 2, 3]] * n}, timeout=30)

        held = pool.submit(embed, 3)
        gate = state_of(app).encoder_gate
        deadline = time.monotonic() + 10
        while gate.queued_requests < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = embed(2)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
        assert refused.headers["Retry-After"] == "1"
        one = pool.submit(embed, 1)   # 3 + 1 fit the cap
        encoder.release.set()
        assert held.result().status_code == 200 and one.result().status_code == 200


def test_embeddings_count_against_their_callers_concurrency() -> None:
    with encoder_app(ServerConfig(max_concurrent_per_key=1)) as (url, app, encoder), ThreadPoolExecutor(1) as pool:
        held = pool.submit(lambda: httpx.post(url + "/v1/embeddings", json={"input": [[1, 2]]}, timeout=30))
        gate = state_of(app).encoder_gate
        deadline = time.monotonic() + 10
        while gate.queued_requests < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        second = httpx.post(url + "/v1/embeddings", json={"input": [[3]]}, timeout=30)
        assert second.status_code == 429 and second.json()["error"]["code"] == "concurrency_limit_exceeded"
        encoder.release.set()
        assert held.result().status_code == 200
        after = httpx.post(url + "/v1/embeddings", json={"input": [[3]]}, timeout=30)
        assert after.status_code == 200   # the first one's place was given back
