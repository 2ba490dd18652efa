"""Speculative decoding (runtime/decoding/speculative.py): the n-gram drafter, the acceptance rule and the
adaptive depth on their own; then on the tiny random Llama, seeded sampling with drafts forced
(some accepted, some rejected) token for token the plain output, and unseeded sampling equal in
distribution (a chi-square test with fixed seeds), the pool at its baseline after rejections and
cancels, no compilation after warm-up; on the real SmolLM2, greedy chat outputs identical with
and without speculation, alone and batched, drafts accepted on a prompt the answer repeats; and
the usage fields on each dialect through the real server."""
from __future__ import annotations

import itertools
from pathlib import Path

import httpx
import numpy as np
import pytest
from support.servers import MODEL, fake_server, live_server, openai_client, wait_idle  # noqa: F401

from imp_jax.runtime.features import speculation as speculation_module
from imp_jax.runtime.request import GenerationRequest, SamplingParams
from imp_jax.runtime.features import speculation_allowed
from imp_jax.runtime.decoding.speculative import MAX_BACKOFF, SpecState, accepted_prefix, ngram_draft

_ids = itertools.count()


# ------------------------------------------------------------------------------ drafter alone
def test_ngram_draft_continues_the_most_recent_longest_match() -> None:
    ids = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # suffix (1, 2, 3) occurred at 0: continue with 4, 5, ...
    assert ngram_draft(ids, 3) == [4, 5, 9]
    # suffix (2, 3) last occurred at 6 (most recent), when 3-grams do not match
    assert ngram_draft([2, 3, 7, 8, 2, 3, 6, 0, 2, 3], 2, sizes=(3, 2)) == [6, 0]
    assert ngram_draft([5, 6, 7, 5], 4, sizes=(2, 1)) == [6, 7, 5]   # a 1-gram; the continuation stops at the end
    assert ngram_draft([5, 6, 7, 5], 4) == []             # by default 2-grams at least
    assert ngram_draft([1, 2, 3, 4], 4) == []             # nothing repeats
    assert ngram_draft([1, 2, 1, 2], 0) == []
    assert ngram_draft([7], 3) == [] and ngram_draft([], 3) == []
    assert ngram_draft(np.array([4, 4, 4, 4]), 5) == [4]  # the most recent match leaves one token after it


def test_accepted_prefix() -> None:
    assert accepted_prefix([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted_prefix([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accepted_prefix([5], [4, 5]) == 0
    assert accepted_prefix([], [3]) == 0


def test_depth_grows_on_hits_and_backs_off_on_misses() -> None:
    s = SpecState(max_k=7)
    assert s.depth() == 2
    s.record(2, 2)
    assert s.depth() == 4
    s.record(4, 4)
    assert s.depth() == 7                    # capped
    s.record(7, 3)
    assert s.depth() == 4                    # one past what was accepted
    s.record(4, 0)                           # a miss: plain steps for a while
    assert s.depth() == 0 and s.backoff == 4
    for _ in range(4):
        s.plain_step()
    assert s.depth() == 1
    for _ in range(10):
        s.record(1, 0)
        while s.backoff:
            s.plain_step()
    s.record(1, 0)
    assert s.backoff == MAX_BACKOFF
    assert s.usage() == {"imp_spec_drafted": 28, "imp_spec_accepted": 9, "imp_spec_emitted": 9 + 15,
                         "imp_spec_verify_steps": 15}
    assert SpecState(max_k=0).depth() == 0


def test_speculation_allowed_only_where_rows_are_independent() -> None:
    params = SamplingParams()
    request = GenerationRequest("r", [1], params)
    assert speculation_allowed(params, request)
    assert not speculation_allowed(params, GenerationRequest("r", [1], params, speculative=False))
    assert not speculation_allowed(params, GenerationRequest("r", [1], params, constraint='{"type": "object"}'))
    assert not speculation_allowed(params, GenerationRequest("r", [1], params, cfg_scale=2.0))
    assert not speculation_allowed(SamplingParams(logit_lens=3), request)
    for field, value in (("dry_multiplier", 0.8), ("mirostat", 2), ("banned_strings", ["x"]), ("banned_regex", ["a+"])):
        assert not speculation_allowed(SamplingParams(**{field: value}), request), field
    for field, value in (("dry_multiplier", 0.0), ("mirostat", 0), ("banned_strings", []), ("banned_regex", [])):
        assert speculation_allowed(SamplingParams(**{field: value}), request), field


# ------------------------------------------------------------------------------ tiny engine
POOL = 40


@pytest.fixture(scope="module")
def tiny(_tiny_hf_template: Path):
    import jax.numpy as jnp

    from imp_jax.model.formats.loader import load_model
    from imp_jax.runtime.config import EngineConfig
    from imp_jax.runtime.core.engine import EngineCore
    from imp_jax.runtime.parallel.sharding import default_mesh

    loaded = load_model(_tiny_hf_template, dtype="float32")
    config = EngineConfig(model=str(_tiny_hf_template), max_model_len=128, max_num_seqs=16,
                          max_num_batched_tokens=32, block_size=16, num_kv_blocks=POOL, async_scheduling="on",
                          speculative_max_batch=0)   # batches of 4 draft too: what these tests check
    shape = loaded.model.kv_cache_shape(POOL, 16)
    core = EngineCore(loaded, config, (jnp.zeros(shape), jnp.zeros(shape)), POOL, default_mesh())
    core.step_fn.warm_up()
    return core


def request(prompt: list[int], speculative: bool | None = True, **params):
    from imp_jax.runtime.request import GenerationRequest, SamplingParams

    params.setdefault("temperature", 0.0)
    return GenerationRequest(f"spec-{next(_ids)}", list(prompt), SamplingParams(**params), speculative=speculative)


def run(core, *reqs) -> list[list]:
    """Each request's events, all stepped together to the end; the pool back at its baseline."""
    events: list[list] = [[] for _ in reqs]
    for req, evs in zip(reqs, events):
        core.add_request(req, evs.append)
    for _ in range(2000):
        if not core.has_work():
            break
        core.step()
    assert not core.requests and core.pool.num_free_blocks == core.baseline_free_blocks
    return events


def tokens(events) -> list[int]:
    return [t for e in events for t in e.token_ids]


PROMPT = [5, 17, 42, 99, 3, 77, 120, 8, 61, 200, 14, 33, 150, 9, 71, 240, 2, 57, 88, 130]


@pytest.fixture
def forced_drafts(monkeypatch):
    """Every drafting attempt proposes `table[position]...`: drafts the test chooses, whatever the text."""
    table: dict[str, list[int]] = {"drafts": []}

    def draft(ids, k, sizes=None):
        return table["drafts"][:k]

    monkeypatch.setattr(speculation_module, "ngram_draft", draft)
    return table


def test_seeded_sampling_with_forced_drafts_is_the_plain_output(tiny, forced_drafts) -> None:
    """A seeded row's key is its position, so drafts accepted or not leave the tokens as they were:
    the drafts here are the plain output's own next tokens (accepted) or wrong ones (rejected)."""
    knobs = dict(temperature=0.9, top_k=6, repetition_penalty=1.3, max_tokens=12, ignore_eos=True, logprobs=2)
    plain = [tokens(ev) for ev in run(tiny, *[request(PROMPT[i:], False, seed=s, **knobs)
                                               for i, s in enumerate((1, 2, 3))])]
    before = tiny.stats()
    forced_drafts["drafts"] = [plain[0][1], plain[0][2], 7]    # right for a while in request 0, then wrong
    spec = [tokens(ev) for ev in run(tiny, *[request(PROMPT[i:], True, seed=s, **knobs)
                                              for i, s in enumerate((1, 2, 3))])]
    after = tiny.stats()
    assert spec == plain
    drafted = after["spec_drafted_total"] - before["spec_drafted_total"]
    accepted = after["spec_accepted_total"] - before["spec_accepted_total"]
    assert drafted > 0 and 0 < accepted < drafted
    assert tiny.step_fn.compilations_after_warmup == 0


def test_unseeded_sampling_keeps_the_distribution(tiny, forced_drafts) -> None:
    """The first two sampled tokens' frequencies with drafts (d1, d2) forced vs without, unseeded (each
    step's key differs): a chi-square test of homogeneity, deterministic (the engine's step keys are)."""
    knobs = dict(temperature=1.0, top_k=4, max_tokens=4, ignore_eos=True)
    probe = tokens(run(tiny, request(PROMPT, False, **knobs))[0])
    forced_drafts["drafts"] = [probe[1], probe[2]]

    def sample(speculative: bool, n: int = 240) -> list[tuple[int, int]]:
        out = []
        for _ in range(n // 4):
            out += [tuple(tokens(ev)[1:3]) for ev in run(tiny, *[request(PROMPT, speculative, **knobs)
                                                                  for _ in range(4)])]
        return out

    before = tiny.stats()
    spec = sample(True)
    mid = tiny.stats()
    plain = sample(False)
    assert tiny.stats()["spec_drafted_total"] == mid["spec_drafted_total"]   # the plain arm drafted nothing
    accepted = mid["spec_accepted_total"] - before["spec_accepted_total"]
    drafted = mid["spec_drafted_total"] - before["spec_drafted_total"]
    assert 10 <= accepted < drafted / 2     # both the accept and the reject paths ran
    for pos in (0, 1):
        a = np.array([t[pos] for t in spec])
        b = np.array([t[pos] for t in plain])
        cats = sorted(set(a) | set(b))
        table = np.array([[np.sum(a == c) for c in cats], [np.sum(b == c) for c in cats]], float)
        table = table[:, table.sum(0) >= 10]   # categories with enough counts for the test
        expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
        chi2 = float(((table - expected) ** 2 / expected).sum())
        dof = table.shape[1] - 1
        assert dof >= 1
        assert chi2 < dof + 4 * np.sqrt(2 * dof) + 4, (pos, chi2, dof, table)   # far past p = 0.001


def test_cancel_mid_verify_and_rejections_free_every_block(tiny, forced_drafts) -> None:
    forced_drafts["drafts"] = [250, 251, 252]   # almost surely rejected
    events: list = []
    tiny.add_request(request(PROMPT * 3, True, max_tokens=40, ignore_eos=True), events.append)
    other: list = []
    tiny.add_request(request(PROMPT, True, max_tokens=20, ignore_eos=True), other.append)
    for _ in range(200):
        tiny.step()
        if tiny._inflight is not None and any(c.drafts for c in tiny._inflight.chunks):
            break
    else:
        pytest.fail("no verify step")
    tiny.cancel(events[0].request_id if events else next(iter(tiny.requests)))
    while tiny.has_work():
        tiny.step()
    assert not tiny.requests and tiny.pool.num_free_blocks == tiny.baseline_free_blocks
    assert tiny.step_fn.compilations_after_warmup == 0


def test_mtp_k_is_declined_in_usage(tiny) -> None:
    req = request(PROMPT, None, max_tokens=3)
    req.spec_mtp_k = 2
    usage = run(tiny, req)[0][-1].usage
    assert usage.spec["imp_spec_declined"] == 1 and usage.spec["imp_spec_declined_detail"] == "no_mtp_head"
    usage = run(tiny, request(PROMPT, False, max_tokens=3))[0][-1].usage
    assert usage.spec is None


# ------------------------------------------------------------------------------ SmolLM2
CHATS = [
    "Repeat the following text exactly, word for word:\n\nThe lighthouse keeper climbed the spiral stairs every "
    "evening at dusk, counting the steps as his father had taught him. Below, the harbour filled with fishing "
    "boats returning from the grey northern sea.",
    "Write a Python function that adds two numbers and a second one that multiplies them.",
    "What is the capital of France?",
    "Summarise in one sentence: The lighthouse keeper climbed the spiral stairs every evening at dusk, "
    "counting the steps as his father had taught him, and lit the lamp for the fishing boats.",
]


@pytest.fixture(scope="module")
def smol(smollm2_loaded, smollm2_gguf_path: Path):
    """The real SmolLM2 with test_engine's sizing (the same step programs, from the compilation cache)."""
    import jax.numpy as jnp

    from imp_jax.kernels_pallas import kv_storage_dtype
    from imp_jax.runtime.core.builder import enable_compilation_cache
    from imp_jax.runtime.config import EngineConfig
    from imp_jax.runtime.core.engine import EngineCore
    from imp_jax.runtime.parallel.sharding import default_mesh

    config = EngineConfig(model=str(smollm2_gguf_path), max_model_len=256, max_num_seqs=8,
                          max_num_batched_tokens=16, num_kv_blocks=96, speculative_max_batch=0)
    enable_compilation_cache(config)
    loaded = smollm2_loaded
    shape = loaded.model.kv_cache_shape(96, config.block_size)
    kv = tuple(jnp.zeros(shape, kv_storage_dtype(loaded.dtype, "cpu")) for _ in range(2))
    core = EngineCore(loaded, config, kv, 96, default_mesh())
    core.step_fn.warm_up()
    return core


@pytest.fixture(scope="module")
def chat_prompts(smol) -> list[list[int]]:
    tok = smol.tokenizer
    return [tok.encode_chat(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True))
            for c in CHATS]


def test_greedy_chat_is_identical_with_and_without_speculation(smol, chat_prompts) -> None:
    """Greedy with the model's default repetition penalty preset (left unset), alone and batched."""
    knobs = dict(temperature=0.0, max_tokens=40)
    plain = [tokens(run(smol, request(p, False, **knobs))[0]) for p in chat_prompts]
    before = smol.stats()
    alone = [tokens(run(smol, request(p, True, **knobs))[0]) for p in chat_prompts]
    mid = smol.stats()
    batched = [tokens(ev) for ev in run(smol, *[request(p, True, **knobs) for p in chat_prompts])]
    after = smol.stats()
    assert alone == plain
    assert batched == plain
    for a, b in ((before, mid), (mid, after)):
        assert b["spec_accepted_total"] - a["spec_accepted_total"] >= 10   # the repeating answer drafted
    assert smol.step_fn.compilations_after_warmup == 0


def test_usage_counts_the_verify_steps(smol, chat_prompts) -> None:
    ev = run(smol, request(chat_prompts[0], True, max_tokens=30))[0]
    spec = ev[-1].usage.spec
    assert spec["imp_spec_verify_steps"] > 0 and spec["imp_spec_accepted"] > 0
    assert spec["imp_spec_drafted"] >= spec["imp_spec_accepted"]
    assert spec["imp_spec_emitted"] == spec["imp_spec_accepted"] + spec["imp_spec_verify_steps"]
    assert spec["imp_spec_emitted"] <= ev[-1].usage.completion_tokens


# ------------------------------------------------------------------------------ the server
REPEAT = CHATS[0]


def _chat(url: str, **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": REPEAT}], "max_tokens": 30, "temperature": 0}
    return httpx.post(url + "/v1/chat/completions", json={**body, **extra}, timeout=300)


def test_usage_fields_on_every_dialect(live_server) -> None:  # noqa: F811
    url = live_server.url
    keys = ("imp_spec_drafted", "imp_spec_accepted", "imp_spec_emitted", "imp_spec_verify_steps")
    details = _chat(url, speculative=True).json()["usage"]["completion_tokens_details"]
    assert all(k in details for k in keys) and details["imp_spec_accepted"] > 0
    plain = _chat(url, speculative=False).json()["usage"]["completion_tokens_details"]
    assert not any(k in plain for k in keys)
    text = "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as his father " \
        "had taught him."
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": f"{text}\n{text}\n{text[:40]}",
                                                  "max_tokens": 20, "temperature": 0, "speculative": True},
                   timeout=300).json()
    assert r["usage"]["completion_tokens_details"]["imp_spec_verify_steps"] > 0
    m = httpx.post(url + "/v1/messages", json={"model": MODEL, "max_tokens": 30, "temperature": 0,
                                               "messages": [{"role": "user", "content": REPEAT}],
                                               "speculative": {"mtp_k": 2}}, timeout=300).json()
    assert m["usage"]["imp_spec_declined"] == 1 and m["usage"]["imp_spec_declined_detail"] == "no_mtp_head"
    assert m["usage"]["imp_spec_accepted"] > 0   # the n-gram matcher ran beside the declined head
    resp = httpx.post(url + "/v1/responses", json={"model": MODEL, "input": REPEAT, "max_output_tokens": 30,
                                                   "temperature": 0, "speculative": True}, timeout=300).json()
    assert resp["usage"]["output_tokens_details"]["imp_spec_verify_steps"] > 0
    wait_idle(url)
    metrics = httpx.get(url + "/metrics").text
    for name in ("imp_spec_drafted_total", "imp_spec_accepted_total", "imp_spec_verify_steps_total",
                 "imp_spec_miss_steps_total", "imp_spec_ngram_verify_wall_ms_total"):
        assert name in metrics


@pytest.mark.parametrize("value, param", [
    ("yes", "speculative"), (3, "speculative"), ({"mtp_k": 17}, "speculative.mtp_k"),
    ({"mtp_k": -1}, "speculative.mtp_k"), ({"mtp_k": True}, "speculative.mtp_k"),
    ({"ngram_k": 2.5}, "speculative.ngram_k"), ({"depth": 2}, "speculative.depth")])
def test_bad_speculative_values_are_400s(fake_server, value, param) -> None:  # noqa: F811
    url, _ = fake_server
    for route, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
                        ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
                        ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})):
        r = httpx.post(url + route, json={"model": "fake-model", **body, "speculative": value}, timeout=30)
        assert r.status_code == 400, (route, r.text)
        if route != "/v1/messages":
            assert r.json()["error"]["param"] == param
        else:
            assert r.json()["type"] == "error" and param in r.json()["error"]["message"]


@pytest.mark.parametrize("value", [True, False, {"mtp_k": 0}, {"mtp_k": 16, "ngram_k": 0}, None])
def test_good_speculative_values_are_accepted(fake_server, value) -> None:  # noqa: F811
    url, _ = fake_server
    r = httpx.post(url + "/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 2,
                                                  "speculative": value}, timeout=30)
    assert r.status_code == 200, r.text
