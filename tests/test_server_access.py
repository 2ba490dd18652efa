"""API keys, the rate limit, the body limit, CORS and request ids, on the operations server (real engine)."""
from __future__ import annotations

import asyncio
import time

import anthropic
import httpx
import openai
import pytest
from support.servers import (MODEL, OPS_ADMIN_KEY, OPS_FILE_KEYS, OPS_KEY, OPS_MAX_BYTES, OPS_ORIGIN, OPS_RATE_LIMIT, FakeEngine,
                             OpsServer, fake_tokenizer)

from imp_jax.server.app import create_app
from imp_jax.server.config import ServerConfig

pytestmark = pytest.mark.real_model

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ROUTES = [  # (method, path, body): one per route class
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2}),
    ("POST", "/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": CHAT["messages"]}),
    ("POST", "/v1/messages/count_tokens", {"model": MODEL, "messages": CHAT["messages"]}),
    ("POST", "/tokenize", {"content": "hi"}),
    ("GET", "/v1/models", None),
    ("GET", "/props", None),
    ("GET", "/metrics", None),
    ("GET", "/v1/responses/resp_unknown", None),
    ("GET", "/no/such/route", None),
    # the operator's routes (none of these changes the server here: no LoRA slots, no models dir, not suspended)
    ("POST", "/admin/lora/load", {"path": "/x"}),
    ("POST", "/admin/lora/unload", {"name": "x"}),
    ("POST", "/admin/models/load", {"model": "x"}),
    ("POST", "/admin/resume", None),
    ("POST", "/v1/requests/req_unknown/end_thinking", None),
]


def _call(url: str, method: str, path: str, body: dict | None, headers: dict[str, str]) -> httpx.Response:
    return httpx.request(method, url + path, json=body, headers=headers, timeout=60)


def _is_auth_refusal(r: httpx.Response, path: str) -> bool:
    """A 401 in the path's own envelope, with WWW-Authenticate and a request id."""
    assert r.status_code == 401, (path, r.status_code, r.text)
    body = r.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
        assert body["request_id"] == r.headers["request-id"] == r.headers["x-request-id"]
    else:
        assert body["error"]["type"] == "authentication_error" and body["error"]["code"] == "invalid_api_key"
    return r.headers["www-authenticate"] == "Bearer" and r.headers["x-request-id"].startswith("req_")


@pytest.mark.parametrize("method, path, body", ROUTES, ids=[p for _, p, _ in ROUTES])
def test_every_route_but_the_probes_needs_a_key(ops_server: OpsServer, method: str, path: str,
                                                body: dict | None) -> None:
    url = ops_server.url
    assert _is_auth_refusal(_call(url, method, path, body, {}), path)
    assert _is_auth_refusal(_call(url, method, path, body, {"Authorization": "Bearer nope"}), path)
    assert _is_auth_refusal(_call(url, method, path, body, {"x-api-key": OPS_KEY + "x"}), path)
    assert _is_auth_refusal(_call(url, method, path, body, {"Authorization": OPS_KEY}), path)  # no scheme
    for headers in ({"Authorization": f"Bearer {OPS_KEY}"}, {"x-api-key": OPS_FILE_KEYS[0]}):
        r = _call(url, method, path, body, headers)
        if path.startswith("/admin/"):   # these keys are not granted 'admin'
            assert (r.status_code, r.json()["error"]["code"]) == (403, "not_granted"), (headers, r.text)
        else:
            assert r.status_code != 401 and r.status_code < 500, (headers, r.text)
    r = _call(url, method, path, body, {"Authorization": f"Bearer {OPS_ADMIN_KEY}"})
    assert r.status_code not in (401, 403) and r.status_code < 500, r.text


def test_probes_need_no_key(ops_server: OpsServer) -> None:
    assert httpx.get(ops_server.url + "/health").status_code == 200
    assert httpx.get(ops_server.url + "/ready").status_code == 200


def test_the_sdks_send_their_keys(ops_server: OpsServer) -> None:
    base = ops_server.url
    good = openai.OpenAI(base_url=base + "/v1", api_key=OPS_KEY, max_retries=0, timeout=60)
    assert good.chat.completions.create(**CHAT).choices[0].message.content is not None
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
    claude = anthropic.Anthropic(base_url=base, api_key=OPS_FILE_KEYS[0], max_retries=0, timeout=60)
    assert claude.messages.create(model=MODEL, max_tokens=2, messages=CHAT["messages"]).content
    with pytest.raises(anthropic.AuthenticationError) as info:
        anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=CHAT["messages"])
    assert info.value.body["error"]["type"] == "authentication_error"


def test_rate_limit_answers_429_with_retry_after(ops_server: OpsServer) -> None:
    url, key = ops_server.url, {"x-api-key": OPS_FILE_KEYS[1]}  # this key is spent here alone
    started = time.monotonic()
    with httpx.Client(base_url=url, headers=key) as client:
        codes = []
        while len(codes) < 3 * OPS_RATE_LIMIT and (not codes or codes[-1] == 200):
            r = client.get("/v1/models")
            codes.append(r.status_code)
    elapsed = time.monotonic() - started
    # a burst of the whole minute's allowance, plus what refilled (one a second) while it ran
    assert codes[-1] == 429 and OPS_RATE_LIMIT <= len(codes) - 1 <= OPS_RATE_LIMIT + elapsed * OPS_RATE_LIMIT / 60 + 1
    # the refusal itself (a request sent after it could find a refilled token on a slow machine)
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert r.json()["error"]["type"] == "rate_limit_error"
    retry = int(r.headers["retry-after"])
    assert 1 <= retry <= 60 / OPS_RATE_LIMIT + 1
    for _ in range(5):   # the few tokens that refilled meanwhile are spent first
        m = httpx.post(url + "/v1/messages/count_tokens", json={"model": MODEL, "messages": CHAT["messages"]},
                       headers=key)
        if m.status_code == 429:
            break
    assert m.status_code == 429 and m.json()["error"]["type"] == "rate_limit_error"
    assert httpx.get(url + "/v1/models", headers={"x-api-key": OPS_KEY}).status_code == 200  # per key
    assert httpx.get(url + "/metrics", headers=key).status_code == 200   # scrapes and probes are not limited
    assert httpx.get(url + "/health").status_code == 200
    time.sleep(retry)
    assert httpx.get(url + "/v1/models", headers=key).status_code == 200


def test_a_body_over_the_limit_is_a_413(ops_server: OpsServer) -> None:
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * OPS_MAX_BYTES}]}
    r = httpx.post(ops_server.url + "/v1/chat/completions", json=big, headers=OpsServer.auth())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    m = httpx.post(ops_server.url + "/v1/messages", json={**big, "max_tokens": 2}, headers=OpsServer.auth())
    assert m.status_code == 413 and m.json()["error"]["type"] == "request_too_large"

    def chunks():  # no Content-Length: the limit holds while the body is read
        for _ in range(OPS_MAX_BYTES // 1000 + 2):
            yield b" " * 1000
    c = httpx.post(ops_server.url + "/v1/completions", content=chunks(),
                   headers={**OpsServer.auth(), "Content-Type": "application/json"})
    assert c.status_code == 413 and c.json()["error"]["code"] == "request_too_large"


def test_cors_is_answered_for_the_configured_origin_only(ops_server: OpsServer) -> None:
    url = ops_server.url
    pre = httpx.options(url + "/v1/chat/completions", headers={
        "Origin": OPS_ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == OPS_ORIGIN
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert pre.headers["access-control-allow-headers"] == "authorization, content-type"
    r = httpx.post(url + "/v1/chat/completions", json=CHAT, headers={**OpsServer.auth(), "Origin": OPS_ORIGIN},
                   timeout=60)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == OPS_ORIGIN
    assert "X-Request-Id" in r.headers["access-control-expose-headers"]
    other = httpx.get(url + "/v1/models", headers={**OpsServer.auth(), "Origin": "http://evil.example"})
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    assert httpx.options(url + "/v1/models", headers={"Origin": "http://evil.example",
                                                      "Access-Control-Request-Method": "GET"}).status_code == 401


def test_every_answer_carries_a_request_id(ops_server: OpsServer) -> None:
    url = ops_server.url
    bad_json = httpx.post(url + "/v1/chat/completions", content=b"{", headers=OpsServer.auth())
    assert bad_json.status_code == 400 and bad_json.headers["x-request-id"].startswith("req_")
    assert httpx.get(url + "/health").headers["x-request-id"].startswith("req_")
    refused = httpx.post(url + "/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "mine-1"})
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "mine-1"


# --------------------------------------------------------------------------- in process, over FakeEngine
def _app(**config: object):
    engine = FakeEngine(fake_tokenizer())
    engine.state = "ready"
    return create_app(engine, ServerConfig(**config))  # type: ignore[arg-type]


def test_metrics_public_opens_metrics_only() -> None:
    """A config switch, not engine behaviour: checked in process (a second live server would cost a start)."""
    async def run() -> tuple[int, int, int]:
        app = _app(api_key=["k"], metrics_public=True)
        async with app.test_app() as test_app:
            client = test_app.test_client()
            return ((await client.get("/metrics")).status_code, (await client.get("/v1/models")).status_code,
                    (await client.get("/v1/models", headers={"x-api-key": "k"})).status_code)
    assert asyncio.run(run()) == (200, 401, 200)


def test_without_keys_the_rate_limit_is_per_client_address() -> None:
    async def run() -> list[int]:
        app = _app(rate_limit=2)
        async with app.test_app() as test_app:
            client = test_app.test_client()
            return [(await client.get("/v1/models")).status_code for _ in range(3)]
    assert asyncio.run(run()) == [200, 200, 429]


def test_the_new_settings_are_flags_and_config_keys(tmp_path) -> None:
    from imp_jax.runtime.config import EngineConfig
    from imp_jax.server.cli import parse_config

    keys = tmp_path / "keys.txt"
    keys.write_text("k-file  # a comment\n\n# another\nk-file-2\n")
    cfg = tmp_path / "imp.toml"
    cfg.write_text(f'api_key = "k-toml"\napi-key-file = "{keys}"\nrate_limit = 30\ncors_origins = "http://a, http://b"\n'
                   'request-timeout = 2.5\nmax_tokens = 64\nmetrics_public = true\n')
    config = parse_config(["--config", str(cfg), "--api-key", "k1", "--api-key", "k2", "--max-queued-tokens", "9"],
                          EngineConfig)
    assert config.api_keys() == ["k1", "k2", "k-file", "k-file-2"]     # flags win over the file's api_key
    assert (config.rate_limit, config.request_timeout, config.max_tokens, config.max_queued_tokens) == (30, 2.5, 64, 9)
    assert config.cors_origins == ["http://a", "http://b"] and config.metrics_public is True
    assert parse_config(["--config", str(cfg)], EngineConfig).api_keys() == ["k-toml", "k-file", "k-file-2"]


@pytest.mark.parametrize("argv", [["--rate-limit", "-1"], ["--max-tokens", "0"], ["--api-key-file", "/no/such/file"],
                                  ["--otlp-endpoint", "collector:4318"], ["--stream-stall-timeout", "0"]])
def test_bad_settings_stop_the_server_at_start(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from imp_jax.runtime.config import EngineConfig
    from imp_jax.server.cli import parse_config

    with pytest.raises(SystemExit):
        parse_config(argv, EngineConfig)
    assert "bad server setting" in capsys.readouterr().err


def test_a_request_id_names_only_the_callers_own_request() -> None:
    """With keys, /v1/requests/{id}/end_thinking by another key's response id or X-Request-Id is a 404 as
    for no request, and a second key's X-Request-Id of the same spelling does not take the first's over."""
    import json

    from support.servers import app_in_thread, wait_for

    engine = FakeEngine(fake_tokenizer(), token_delay=0.05)
    engine.start()
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "stream": True}
    with app_in_thread(create_app(engine, ServerConfig(api_key=["ka", "kb"]))) as url:
        wait_for(url + "/ready", 200, timeout=30)
        end = lambda key, rid: httpx.post(f"{url}/v1/requests/{rid}/end_thinking",   # noqa: E731
                                          headers={"x-api-key": key}, timeout=10)
        with httpx.stream("POST", url + "/v1/chat/completions", json=chat, timeout=30,
                          headers={"x-api-key": "ka", "X-Request-Id": "mine"}) as stream:
            lines = stream.iter_lines()   # held: a closed iterator closes the stream (the request is cancelled)
            first = next(line for line in lines if line.startswith("data: "))
            response_id = json.loads(first[len("data: "):])["id"]
            theirs = httpx.post(url + "/v1/chat/completions", json={**chat, "stream": False, "max_tokens": 2},
                                headers={"x-api-key": "kb", "X-Request-Id": "mine"}, timeout=30)
            assert theirs.status_code == 200
            for rid in ("mine", response_id):
                assert end("kb", rid).status_code == 404 and end("kb", rid).json()["error"]["code"] == "request_not_found"
                assert end("ka", rid).status_code == 409   # found: the fake's requests do not think
