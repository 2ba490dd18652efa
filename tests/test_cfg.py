"""Classifier-free guidance (cfg_scale): a shadow sequence decodes another prompt in the same steps and
the main row samples from l_b + s (l_a - l_b). On the tiny random Llama: CFG's greedy tokens and
logprobs vs two plain transformers passes, one per prompt, step by step; the pool back at its
baseline after finish, cancel and preemption; rows without CFG unchanged; the 400s. Then the chat
route's 400s over the FakeEngine."""
from __future__ import annotations

import itertools
from pathlib import Path

import httpx
import numpy as np
import pytest
from paged import tiny_engine
from support.servers import MODEL, fake_server, live_server, openai_client, wait_idle  # noqa: F401

_ids = itertools.count()
MAIN = [5, 17, 42, 99, 3, 77, 120, 8, 61, 200, 14, 33, 150, 9, 71, 240, 2, 57, 88, 130]   # 20 tokens
SHADOW = [14, 33, 150, 9, 71, 240, 2, 57, 88, 130, 66, 21]                                   # 12 tokens
POOL = 12   # 11 usable blocks of 16: three pairs of 20 + 40 and 12 + 40 tokens cannot all fit


@pytest.fixture(scope="module")
def tiny(_tiny_hf_template: Path):
    return tiny_engine(_tiny_hf_template, POOL)


def request(prompt: list[int], shadow: list[int] | None = None, scale: float = 1.0, **params):
    from imp_jax.runtime.request import GenerationRequest, SamplingParams

    return GenerationRequest(f"cfg-{next(_ids)}", prompt, SamplingParams(**params), cfg_scale=scale,
                             cfg_prompt_ids=shadow)


def run(core, *reqs) -> list[list]:
    """Each request's events, all stepped together to the end."""
    events: list[list] = [[] for _ in reqs]
    for req, evs in zip(reqs, events):
        core.add_request(req, evs.append)
    while core.has_work():
        core.step()
    return events


def tokens(events, index: int = 0) -> list[int]:
    return [t for e in events if e.index == index for t in e.token_ids]


def test_guided_tokens_follow_the_combined_logits_of_two_plain_passes(tiny):
    import torch

    core, hf = tiny
    scale = 3.0
    neutral = dict(top_p=1.0, top_k=0, min_p=0.0, typical_p=1.0, repetition_penalty=1.0)   # logprobs: unprocessed
    (events,) = run(core, request(MAIN, SHADOW, scale, temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True,
                                  **neutral))
    out = tokens(events)
    entries = [lp for e in events for lp in (e.logprobs or [])]
    assert len(out) == 8
    with torch.no_grad():
        for k, tok in enumerate(out):
            la = hf(torch.tensor([MAIN + out[:k]])).logits[0, -1].double().numpy()
            lb = hf(torch.tensor([SHADOW + out[:k]])).logits[0, -1].double().numpy()
            guided = lb + scale * (la - lb)
            assert tok == int(np.argmax(guided)), k
            lp = guided - guided.max() - np.log(np.exp(guided - guided.max()).sum())
            assert entries[k].logprob == pytest.approx(lp[tok], abs=1e-3)
            assert [t for t, _ in entries[k].top] == list(np.argsort(-lp, kind="stable")[:5])
    plain = tokens(run(core, request(MAIN, temperature=0.0, max_tokens=8, ignore_eos=True))[0])
    assert plain != out   # the guidance changed something (else this test could not fail)
    stats = core.stats()
    assert stats["num_free_blocks"] == stats["baseline_free_blocks"]
    assert stats["compilations_after_warmup"] == 0


def test_rows_without_guidance_are_unchanged_beside_guided_ones(tiny):
    """Beside a guided pair, a plain row reads what it reads beside two plain rows of the same prompts (the
    same batch shape: a step's rounding may depend on its shape, never on its guidance)."""
    core, _ = tiny
    params = dict(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True)
    plain = run(core, request(SHADOW, **params), request(MAIN, **params), request(SHADOW, **params))[0]
    beside, guided = run(core, request(SHADOW, **params), request(MAIN, SHADOW, 2.0, **params))
    strip = lambda evs: [(lp.token_id, lp.logprob, lp.top) for e in evs for lp in e.logprobs or []]
    assert strip(plain) == strip(beside)
    assert len(tokens(guided)) == 6
    assert core.pool.num_free_blocks == core.baseline_free_blocks


def test_n_choices_each_get_a_shadow_and_free_it(tiny):
    core, _ = tiny
    (events,) = run(core, request(MAIN, SHADOW, 1.5, n=2, temperature=1.0, seed=5, max_tokens=5, ignore_eos=True))
    assert len(tokens(events, 0)) == len(tokens(events, 1)) == 5
    assert events[-1].usage.prompt_tokens == len(MAIN)   # the main prompt only
    assert events[-1].usage.completion_tokens == 10
    assert core.pool.num_free_blocks == core.baseline_free_blocks


def test_cancel_frees_the_shadow(tiny):
    core, _ = tiny
    events: list = []
    req = request(MAIN, SHADOW, 2.0, temperature=0.0, max_tokens=40, ignore_eos=True)
    core.add_request(req, events.append)
    for _ in range(4):
        core.step()
    assert core.pool.num_free_blocks < core.baseline_free_blocks
    core.cancel(req.request_id)
    while core.has_work():
        core.step()
    assert events[-1].finish_reason == "cancelled"
    assert core.pool.num_free_blocks == core.baseline_free_blocks


def test_pairs_are_preempted_whole_and_finish(tiny):
    """Three guided requests outgrow the 11-block pool: pairs are preempted and recomputed, all finish."""
    core, _ = tiny
    before = core.scheduler.num_preemptions
    params = dict(temperature=0.0, max_tokens=40, ignore_eos=True)
    results = run(core, *(request(MAIN[i:], SHADOW, 2.0, **params) for i in range(3)))
    assert core.scheduler.num_preemptions > before
    for i, events in enumerate(results):
        assert len(tokens(events)) == 40 and events[-1].finish_reason == "length"
        (alone,) = run(core, request(MAIN[i:], SHADOW, 2.0, **params))
        assert tokens(alone) == tokens(events)
    assert core.pool.num_free_blocks == core.baseline_free_blocks
    assert core.stats()["compilations_after_warmup"] == 0


@pytest.mark.parametrize("scale, shadow, param", [(11.0, SHADOW, "cfg_scale"), (0.5, SHADOW, "cfg_scale"),
                                                  (2.0, None, "cfg_scale"), (2.0, [1] * 120, "cfg_negative_prompt")])
def test_engine_refuses_guidance_it_cannot_run(tiny, scale, shadow, param):
    from imp_jax.errors import InvalidRequestError

    core, _ = tiny
    with pytest.raises(InvalidRequestError) as e:
        core.add_request(request(MAIN, shadow, scale, max_tokens=20), lambda ev: None)
    assert e.value.param == param
    assert core.pool.num_free_blocks == core.baseline_free_blocks and not core.has_work()


# ------------------------------------------------------------------------------------------ the chat route
CHAT = {"model": "fake-model", "max_tokens": 2,
        "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("body", [
    {"cfg_scale": 0.5}, {"cfg_scale": 10.5}, {"cfg_scale": "2"},
    {"cfg_scale": 2, "messages": [{"role": "user", "content": "hi"}]},                    # no system, no negative
    {"cfg_scale": 2, "messages": [{"role": "system", "content": "only"}]},                  # nothing left
    {"cfg_scale": 2, "tools": [TOOL]},
    {"cfg_scale": 2, "banned_strings": ["x"]},
])
def test_chat_guidance_400s(fake_server, body):  # noqa: F811
    url, _ = fake_server
    r = httpx.post(url + "/v1/chat/completions", json={**CHAT, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] in ("cfg_scale", "banned_strings")


@pytest.mark.parametrize("body", [{"cfg_scale": 2}, {"cfg_scale": 1},
                                  {"cfg_scale": 3, "cfg_negative_prompt": "Be rude.",
                                   "messages": [{"role": "user", "content": "hi"}]}])
def test_chat_guidance_accepted(fake_server, body):  # noqa: F811
    url, _ = fake_server
    r = httpx.post(url + "/v1/chat/completions", json={**CHAT, **body}, timeout=30)
    assert r.status_code == 200, r.text


OTHER_ROUTES = {
    "/v1/completions": {"model": "fake-model", "prompt": "hi", "max_tokens": 2},
    "/v1/messages": {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/responses": {"model": "fake-model", "input": "hi", "max_output_tokens": 2},
}


@pytest.mark.parametrize("route", OTHER_ROUTES)
@pytest.mark.parametrize("field, value", [("cfg_scale", 2), ("cfg_negative_prompt", "x"), ("logit_lens", True),
                                          ("logit_lens", 3)])
def test_other_routes_refuse_chat_only_fields(fake_server, route, field, value):  # noqa: F811
    url, _ = fake_server
    r = httpx.post(url + route, json={**OTHER_ROUTES[route], field: value}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert field in error["message"] and "not supported" in error["message"]
    if route != "/v1/messages":
        assert error["param"] == field and error["code"] == "not_supported"
    ok = httpx.post(url + route, json={**OTHER_ROUTES[route], "cfg_scale": 1, "logit_lens": False}, timeout=30)
    assert ok.status_code == 200, ok.text


PIRATE = [{"role": "system", "content": "You are a pirate. Always answer like a pirate."},
          {"role": "user", "content": "Say hello to me."}]


@pytest.mark.real_model
def test_chat_guidance_with_the_openai_client(openai_client, live_server):  # noqa: F811
    kw = dict(model=MODEL, messages=PIRATE, max_tokens=8, temperature=0)
    plain = openai_client.chat.completions.create(**kw)
    guided = openai_client.chat.completions.create(**kw, extra_body={"cfg_scale": 3})
    assert guided.usage.prompt_tokens == plain.usage.prompt_tokens   # the main prompt only
    assert guided.usage.completion_tokens == 8 or guided.choices[0].finish_reason == "stop"
    stream = openai_client.chat.completions.create(**kw, stream=True, extra_body={"cfg_scale": 3})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == guided.choices[0].message.content
    negative = openai_client.chat.completions.create(
        **kw, extra_body={"cfg_scale": 2, "cfg_negative_prompt": "You are a polite butler."})
    assert negative.choices[0].message.content
    stats = wait_idle(live_server.url)
    assert stats["compilations_after_warmup"] == 0
