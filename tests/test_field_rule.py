"""Nothing silently ignored (server/fields.py): every field a generation route knows is honoured or a 400 naming
it, in the route's own error envelope; docs/API.md lists each route's honoured fields, checked here."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.servers import MODEL, LiveServer, live_server  # noqa: F401

from imp_jax.server import fields

MESSAGE = [{"role": "user", "content": "Say hi."}]
BASE: dict[str, dict[str, Any]] = {   # a valid body per route (answered with one token)
    "/v1/chat/completions": {"model": MODEL, "messages": MESSAGE, "max_tokens": 1},
    "/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 1},
    "/v1/messages": {"model": MODEL, "messages": MESSAGE, "max_tokens": 1},
    "/v1/responses": {"model": MODEL, "input": "Say hi.", "max_output_tokens": 1},
    "/infill": {"model": MODEL, "input_prefix": "def f(", "n_predict": 1},
    "/v1/score": {"model": MODEL, "prompt": "Hi", "candidates": [" there"]},
    "/v1/decide": {"model": MODEL, "question": "Yes?", "options": ["yes", "no"]},
}
# A value that asks for something, per field whose request model types it (a foreign field is not parsed).
SAMPLE: dict[str, Any] = {"stop": ["x"], "user": "x", "stream_options": {"include_usage": True}, "max_tokens": 5,
                          "n": 2, "best_of": 2, "stream": True, "temperature": 0.5}
API_DOC = Path(__file__).resolve().parent.parent / "docs" / "API.md"


def refusals() -> list[tuple[str, str]]:
    """Every (route, field) where the field is known but not honoured."""
    return [(route, name) for route, cls in fields.route_models().items()
            for name in sorted(fields.known_fields() - fields.honoured(cls))]


def test_every_route_declares_its_extras_and_refusals_are_its_own_fields() -> None:
    for route, cls in fields.route_models().items():
        assert isinstance(getattr(cls, "EXTRAS", None), frozenset), route
        assert set(getattr(cls, "REFUSED", {})) <= set(cls.model_fields), route   # refused: declared, inherited


def test_docs_list_each_routes_honoured_fields() -> None:
    """docs/API.md's "Fields each route takes" names exactly what each route honours: a new field fails here
    until it is decided (honoured: listed; else refused by the rule) and documented."""
    text = API_DOC.read_text()
    section = text.split("### Fields each route takes", 1)[1].split("\n#", 1)[0]
    for route, cls in fields.route_models().items():
        line = next((ln for ln in section.splitlines() if ln.startswith(f"`{route}`")), None)
        assert line is not None, f"docs/API.md lists no fields for {route}"
        listed = set(re.findall(r"`([a-z_]+)`", line.split(":", 1)[1]))
        assert listed == set(fields.honoured(cls)), (route, sorted(listed ^ set(fields.honoured(cls))))


@pytest.mark.parametrize("route", list(BASE))
def test_every_known_field_is_honoured_or_a_400_naming_it(live_server: LiveServer, route: str) -> None:
    names = [n for r, n in refusals() if r == route]
    assert names, route
    with httpx.Client(base_url=live_server.url, timeout=60) as client:
        for name in names:
            r = client.post(route, json={**BASE[route], name: SAMPLE.get(name, "x")})
            assert r.status_code == 400, (route, name, r.text)
            body = r.json()
            if route == "/v1/messages":
                assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
                assert body["error"]["message"].startswith(f"'{name}' is not supported on"), body
            else:
                assert body["error"]["param"] == name and body["error"]["code"] == "not_supported", (name, body)
                assert body["error"]["message"].startswith(f"'{name}' is not supported on"), body


def test_a_value_that_asks_for_nothing_is_accepted(live_server: LiveServer) -> None:
    """Clients send defaults: null, false, 0, "", [] and {} of a field the route does not honour are no request."""
    neutral = {"echo": False, "prompt_logprobs": None, "suffix": "", "thinking": {}, "stop_sequences": [],
               "include": []}
    r = httpx.post(live_server.url + "/v1/chat/completions", json={**BASE["/v1/chat/completions"], **neutral},
                   timeout=120)
    assert r.status_code == 200, r.text
    r = httpx.post(live_server.url + "/v1/messages", json={**BASE["/v1/messages"], "logprobs": False, "n": 1,
                                                           "response_format": None}, timeout=120)
    assert r.status_code == 200, r.text


def test_unknown_fields_are_ignored(live_server: LiveServer) -> None:
    """A key no route knows (a vendor extra) is ignored, as vLLM and llama.cpp do (docs/API.md)."""
    r = httpx.post(live_server.url + "/v1/chat/completions",
                   json={**BASE["/v1/chat/completions"], "some_vendor_knob": {"a": 1}}, timeout=120)
    assert r.status_code == 200, r.text


def test_usage_reports_evicted_tokens_as_zero(live_server: LiveServer) -> None:
    r = httpx.post(live_server.url + "/v1/chat/completions", json=BASE["/v1/chat/completions"], timeout=120)
    assert r.json()["usage"]["prompt_tokens_details"]["evicted_tokens"] == 0
