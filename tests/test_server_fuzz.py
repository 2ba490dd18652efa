"""Hypothesis fuzzing of every POST route on the real engine: a 4xx with the route's envelope or a valid answer.

Bodies come from tests/support/fuzz_bodies.py (wrong types, missing and unknown fields, huge and non-finite
numbers, every kind of unicode with lone surrogates, deep nesting, huge arrays, bytes that are not
JSON). Reproducible: derandomized, no example database; a bounded number of examples per route.
"""
from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from support.servers import LiveServer, wait_idle

from support.fuzz_bodies import ROUTES, bodies, check_answer

pytestmark = pytest.mark.real_model

EXAMPLES_PER_ROUTE = 100
FUZZ = settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, derandomize=True, database=None,
                phases=[Phase.explicit, Phase.generate, Phase.shrink],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example, HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("route", ROUTES)
def test_fuzzed_bodies_get_a_4xx_envelope_or_an_answer(reliability_server: LiveServer, route: str) -> None:
    client = httpx.Client(base_url=reliability_server.url, timeout=120)

    @FUZZ
    @given(body=bodies(route))
    def one(body: bytes) -> None:
        r = client.post(route, content=body, headers={"Content-Type": "application/json"})
        check_answer(route, body, r)

    try:
        one()
    finally:
        client.close()
    assert reliability_server.proc.poll() is None, "the server died"
    stats = wait_idle(reliability_server.url)
    assert stats["compilations_after_warmup"] == 0
