"""Spec fields this server does not implement yet are a 400 not_supported naming the field on every
dialect, never ignored; their neutral values ask for nothing and are accepted. The app runs over the
FakeEngine: the refusal happens before any generation."""
from __future__ import annotations

import httpx
import pytest

from imp_jax.server.validation import NOT_YET
from support.servers import fake_server  # noqa: F401

ROUTES = {
    "/v1/chat/completions": {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"model": "fake-model", "prompt": "hi", "max_tokens": 2},
    "/v1/messages": {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/responses": {"model": "fake-model", "input": "hi", "max_output_tokens": 2},
}
ASKING = {
          "xtc_probability": 0.5, "dynatemp_range": 0.3, "top_n_sigma": 1.0}


def test_every_not_yet_field_is_listed_here() -> None:
    assert set(ASKING) == set(NOT_YET)


@pytest.mark.parametrize("route", ROUTES)
def test_fields_not_implemented_are_a_400_naming_them(fake_server, route: str) -> None:  # noqa: F811
    url, _ = fake_server
    for name, value in ASKING.items():
        r = httpx.post(url + route, json={**ROUTES[route], name: value}, timeout=30)
        assert r.status_code == 400, (route, name, r.text)
        error = r.json()["error"]
        assert "not supported" in error["message"] and name in error["message"]
        if route != "/v1/messages":   # Anthropic's envelope has no param/code
            assert error["param"] == name and error["code"] == "not_supported"


def test_neutral_values_are_accepted(fake_server) -> None:  # noqa: F811
    url, _ = fake_server
    neutral = {name: values[-1] for name, values in NOT_YET.items()}
    r = httpx.post(url + "/v1/completions", json={**ROUTES["/v1/completions"], **neutral}, timeout=30)
    assert r.status_code == 200, r.text
