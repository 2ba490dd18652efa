"""DRY (runtime/decoding/dry.py): the host's repeat penalties vs a quadratic NumPy reference written here (hand-built
histories, breakers, allowed_length, penalty_last_n), the breaker table, the compiled sampler's sparse
slots; on the tiny random Llama, greedy DRY tokens vs the plain transformers logits minus the reference
penalties step by step, DRY rows never overlapped, the pool back at its baseline, no compilation after
warm-up; the 400s naming the field on the four routes over the FakeEngine; the real server through the
openai client. Mirostat (runtime/execution/mirostat.py): the kept set and the mu update vs llama.cpp's algorithm in
NumPy, greedy rows, mu carried from step to step through the engine, the 400s, the openai and anthropic
clients."""
from __future__ import annotations

import itertools
import random
from pathlib import Path

import httpx
import numpy as np
import pytest
from paged import tiny_engine
from support.servers import MODEL, fake_server, live_server, openai_client, wait_idle  # noqa: F401

from imp_jax.runtime.decoding.dry import DRY_SLOTS, BreakerTable, DryParams, repeat_penalties, top_slots

_ids = itertools.count()


# ------------------------------------------------------------------------ reference
def reference(history: list[int], p: DryParams, breakers: dict, context: int = 10_000) -> dict[int, float]:
    """DRY by brute force: for every earlier position j, the longest common suffix of history[:j+1] and
    history, capped by the tokens after the last complete breaker; history[j+1] inherits the longest."""
    last_n = context if p.penalty_last_n == -1 else p.penalty_last_n
    h = history[-last_n:] if last_n else []
    n = len(h)
    if not p.on or n <= p.allowed_length:
        return {}
    limit = n
    for i in range(n):          # i tokens from the end
        tok = h[n - 1 - i]
        fits = [len(t) for t in breakers.get(tok, []) if len(t) <= i and list(t) == h[n - i:n - i + len(t)]]
        if fits:
            limit = i - max(fits)
            break
    if limit < p.allowed_length:
        return {}
    best: dict[int, int] = {}
    for j in range(n - 1):
        length = 0
        while length <= j and h[j - length] == h[n - 1 - length]:
            length += 1
        length = min(length, limit)
        if length >= p.allowed_length:
            best[h[j + 1]] = max(best.get(h[j + 1], 0), length)
    return {t: p.multiplier * p.base ** (length - p.allowed_length) for t, length in best.items()
            if () not in breakers.get(t, [])}


def test_llama_cpp_worked_example() -> None:
    a, b, c, y = 1, 2, 3, 9
    got = repeat_penalties([a, b, c, c, b, c, y, a, b, c], DryParams(multiplier=0.8, base=2.0, allowed_length=2),
                           {}, 100)
    # c extends "a b c" (3), y extends "b c" (2); b extends "c" (1 < allowed_length)
    assert got == pytest.approx({c: 0.8 * 2.0, y: 0.8})


@pytest.mark.parametrize("seed", range(40))
def test_penalties_match_the_brute_force_reference(seed: int) -> None:
    rng = random.Random(seed)
    history = [rng.randrange(4) for _ in range(rng.randrange(1, 60))]
    p = DryParams(multiplier=rng.choice([0.0, 0.5, 1.3]), base=rng.choice([1.1, 1.75, 3.0]),
                  allowed_length=rng.randrange(0, 5), penalty_last_n=rng.choice([-1, 0, 8, 30]))
    breakers = rng.choice([{}, {3: [()]}, {2: [(3,)]}, {0: [(1, 1)], 3: [()]}])
    got = repeat_penalties(history, p, breakers, 10_000)
    assert got == pytest.approx(reference(history, p, breakers))


def test_breakers_cap_the_repeat_and_are_never_penalised() -> None:
    p = DryParams(multiplier=1.0, base=2.0, allowed_length=2)
    rep = [5, 6, 7, 8]
    assert repeat_penalties(rep + [1] + rep[:3], p, {}, 100) == {8: 2.0}      # "5 6 7" -> 8, length 3
    assert repeat_penalties(rep + [1] + rep[:3], p, {6: [()]}, 100) == {}      # only "7" after the breaker 6
    assert repeat_penalties(rep + [1] + rep[:3], p, {5: [(6,)]}, 100) == {}    # two-token breaker "5 6"
    assert repeat_penalties(rep + [1] + rep[:3], p, {5: [(9,)]}, 100) == {8: 2.0}   # tail does not match
    assert repeat_penalties([1, 2, 3, 1, 2], p, {3: [()]}, 100) == {}          # 3 would extend "1 2": a breaker


def test_exponent_is_clamped_and_penalty_last_n_windows() -> None:
    h = [1, 2] * 200
    got = repeat_penalties(h, DryParams(multiplier=1.0, base=10.0, allowed_length=0), {}, 10_000)
    assert all(np.isfinite(v) for v in got.values())
    assert repeat_penalties(h, DryParams(multiplier=1.0, base=2.0, allowed_length=2, penalty_last_n=2), {}, 100) == {}
    assert repeat_penalties(h, DryParams(multiplier=1.0, base=2.0, allowed_length=2, penalty_last_n=0), {}, 100) == {}
    assert repeat_penalties(h, DryParams(multiplier=1.0, base=2.0, allowed_length=2), {}, 5) == {1: 2.0}   # "2 1 2" of 5


def test_top_slots_keep_the_largest() -> None:
    pens = {i: float(i % 7) for i in range(100)}
    kept = top_slots(pens)
    assert len(kept) == DRY_SLOTS == 32 and min(v for _, v in kept) == 4.0   # 14 sixes, 14 fives, 4 fours
    assert [v for _, v in kept] == sorted((v for _, v in kept), reverse=True)


class _Tok:
    """A tokenizer over single characters plus a few words."""
    vocab = ("a", "b", "\n", "x\n", "ab:", "q:", ":", "z")

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.vocab[i] for i in ids)

    def encode(self, text, add_special_tokens=True, parse_special=True):
        return [self.vocab.index(ch) for ch in text]


def test_breaker_table_single_tokens_and_overlaps() -> None:
    table = BreakerTable(_Tok(), len(_Tok.vocab))
    got = table.breakers(["\n", "b:"])
    assert got[2] == [()] and got[3] == [()]            # tokens containing "\n"
    assert got[1] == [(6,)]                             # "b" ends with "b", ":" follows
    assert got[4] == [()]                               # "ab:" contains "b:"
    assert 0 not in got and 7 not in got


# ------------------------------------------------------------------------- sampler
def test_sampler_subtracts_the_slots_in_both_skip_modes() -> None:
    import jax

    from imp_jax.runtime.execution.sampling import RowSpec, build_sampling_tensors, sample

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 300)).astype(np.float32)
    top = int(np.argmax(logits[0]))
    rows = [RowSpec(temperature=0.0, dry=[(top, 50.0), (7, 1.5)], wants_top_logprobs=True),
            RowSpec(temperature=0.0, wants_top_logprobs=True)]
    t = build_sampling_tensors(rows, num_rows_bucket=3, vocab_size=300, history_len=8, max_bias=4, with_mask=False)
    want = logits.copy()
    want[0, top] -= 50.0
    want[0, 7] -= 1.5
    for skips in (True, False):
        out = sample(logits, t, jax.random.key(0), num_top_logprobs=3, dynamic_skips=skips)
        assert list(np.asarray(out.tokens[:2])) == list(np.argmax(want[:2], axis=-1))
        lp = want[0] - np.log(np.exp(want[0] - want[0].max()).sum()) - want[0].max()
        np.testing.assert_allclose(np.asarray(out.top_logprobs[0]), np.sort(lp)[::-1][:3], rtol=1e-5, atol=1e-5)
    none = build_sampling_tensors([RowSpec(temperature=0.0)], num_rows_bucket=3, vocab_size=300, history_len=8,
                                  max_bias=4, with_mask=False)
    assert int(sample(logits, none, jax.random.key(0)).tokens[0]) == top


# ------------------------------------------------------------------------- engine
POOL = 12
PROMPT = [5, 17, 42, 99, 3] * 4 + [5, 17]


@pytest.fixture(scope="module")
def tiny(_tiny_hf_template: Path):
    return tiny_engine(_tiny_hf_template, POOL)


def request(prompt: list[int], **params):
    from imp_jax.runtime.request import GenerationRequest, SamplingParams

    return GenerationRequest(f"dry-{next(_ids)}", prompt, SamplingParams(**params))


def run(core, *reqs) -> list[list[int]]:
    events: list[list] = [[] for _ in reqs]
    for req, evs in zip(reqs, events):
        core.add_request(req, evs.append)
    while core.has_work():
        core.step()
    return [[t for e in evs for t in e.token_ids] for evs in events]


NEUTRAL = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "typical_p": 1.0, "repetition_penalty": 1.0,
           "temperature": 0.0, "ignore_eos": True}


def test_engine_dry_tokens_follow_the_reference_step_by_step(tiny) -> None:
    import torch

    core, hf = tiny
    baseline = core.stats()["num_free_blocks"]
    dry = {"dry_multiplier": 2.0, "dry_base": 1.5, "dry_allowed_length": 2}
    overlapped0 = core.counters.overlapped_steps
    with_dry, plain = run(core, request(PROMPT, max_tokens=10, **NEUTRAL, **dry),
                          request(PROMPT, max_tokens=10, **NEUTRAL))
    p = DryParams(2.0, 1.5, 2)
    breakers = core.by_name["dry"].breakers.breakers(p.sequence_breakers)
    penalised_any = False
    with torch.no_grad():
        for k, tok in enumerate(with_dry):
            history = PROMPT + with_dry[:k]
            logits = hf(torch.tensor([history])).logits[0, -1].double().numpy()
            pens = dict(top_slots(reference(history, p, breakers, core.max_model_len)))
            penalised_any |= bool(pens)
            for t, v in pens.items():
                logits[t] -= v
            order = np.argsort(-logits)
            assert tok == order[0] or logits[order[0]] - logits[tok] < 1e-4, k
    assert penalised_any
    strong = {"dry_multiplier": 100.0, "dry_base": 1.75, "dry_allowed_length": 0}   # any seen token extends a repeat
    (out,) = run(core, request(PROMPT, max_tokens=12, **NEUTRAL, **strong))
    exempt = {t for t, tails in breakers.items() if () in tails}
    for k, tok in enumerate(out):
        assert tok in exempt or tok not in (PROMPT + out[:k])[1:], (k, out)
    assert core.step_fn.compilations_after_warmup == 0
    assert core.stats()["num_free_blocks"] == baseline
    assert core.counters.overlapped_steps - overlapped0 <= 10   # only the plain row's steps overlap
    (alone,) = run(core, request(PROMPT, max_tokens=6, **NEUTRAL, **dry))
    assert alone == with_dry[:6]
    (plain_alone,) = run(core, request(PROMPT, max_tokens=10, **NEUTRAL))
    assert plain == plain_alone         # a row without DRY is unchanged beside a DRY row


def test_engine_frees_blocks_and_never_overlaps_a_dry_row(tiny) -> None:
    core, _ = tiny
    baseline = core.stats()["num_free_blocks"]
    before = core.counters.overlapped_steps
    run(core, request(PROMPT, max_tokens=12, temperature=1.0, seed=3, ignore_eos=True, dry_multiplier=0.8))
    assert core.counters.overlapped_steps == before
    run(core, request(PROMPT, max_tokens=12, temperature=1.0, seed=3, ignore_eos=True))
    assert core.counters.overlapped_steps > before      # the same request without DRY does overlap
    assert core.stats()["num_free_blocks"] == baseline
    assert core.step_fn.compilations_after_warmup == 0


# ------------------------------------------------------------------------- server
ROUTES = {
    "/v1/chat/completions": {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"model": "fake-model", "prompt": "hi", "max_tokens": 2},
    "/v1/messages": {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/responses": {"model": "fake-model", "input": "hi", "max_output_tokens": 2},
}
BAD = [("dry_multiplier", -0.1), ("dry_multiplier", 101), ("dry_multiplier", "x"),
       ("dry_base", 1.0), ("dry_base", 11), ("dry_allowed_length", -1), ("dry_penalty_last_n", -2),
       ("dry_sequence_breakers", "\n"), ("dry_sequence_breakers", [""]), ("dry_sequence_breakers", ["x" * 41]),
       ("dry_sequence_breakers", ["a"] * 17), ("dry_sequence_breakers", [3])]


@pytest.mark.parametrize("route", ROUTES)
def test_bad_dry_values_are_400s_naming_the_field(fake_server, route: str) -> None:  # noqa: F811
    url, _ = fake_server
    for name, value in BAD:
        body = {**ROUTES[route], "dry_multiplier": 0.8, name: value}
        r = httpx.post(url + route, json=body, timeout=30)
        assert r.status_code == 400, (route, name, value, r.text)
        error = r.json()["error"]
        assert name in error["message"], (route, name, error)
        if route != "/v1/messages":
            assert error["param"].startswith(name), error   # a list item: "dry_sequence_breakers.0"


@pytest.mark.parametrize("route", ROUTES)
def test_dry_fields_are_accepted(fake_server, route: str) -> None:  # noqa: F811
    url, _ = fake_server
    body = {**ROUTES[route], "dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2,
            "dry_penalty_last_n": 64, "dry_sequence_breakers": ["\n", "###"]}
    r = httpx.post(url + route, json=body, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.real_model
def test_dry_through_the_openai_client(openai_client, live_server) -> None:  # noqa: F811
    chat = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count: one two one two one two"}], max_tokens=12,
        temperature=0, extra_body={"dry_multiplier": 0.8, "dry_allowed_length": 2})
    assert chat.choices[0].message.content
    text = openai_client.completions.create(model=MODEL, prompt="a b c a b c a b c", max_tokens=8,
                                            extra_body={"dry_multiplier": 1.5, "dry_sequence_breakers": ["\n"]})
    assert text.choices[0].text
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2, extra_body={"dry_multiplier": 1, "dry_base": 0.5})
    assert e.value.body["param"] == "dry_base"
    stats = wait_idle(live_server.url)
    assert stats["compilations_after_warmup"] == 0


def test_a_dry_request_never_drafts(tiny) -> None:
    """speculation_allowed keeps DRY sequences from drafting (their penalties would need the drafts'
    history updated row by row): `speculative: true` changes nothing, on a prompt that drafts without DRY."""
    from imp_jax.runtime.request import GenerationRequest, SamplingParams

    core, _ = tiny
    dry = {"dry_multiplier": 0.3, "dry_base": 1.2, "dry_allowed_length": 4}
    drafted = core.counters.spec_drafted

    def one(speculative: bool) -> list[int]:
        params = SamplingParams(max_tokens=16, **NEUTRAL, **dry)
        return run(core, GenerationRequest(f"dry-{next(_ids)}", PROMPT * 2, params, speculative=speculative))[0]

    off, on = one(False), one(True)
    assert core.counters.spec_drafted == drafted
    assert on == off
    run(core, GenerationRequest(f"dry-{next(_ids)}", PROMPT * 2, SamplingParams(max_tokens=16, **NEUTRAL),
                                speculative=True))
    assert core.counters.spec_drafted > drafted     # the same prompt without DRY does draft
    assert core.step_fn.compilations_after_warmup == 0


# ------------------------------------------------------------------------- mirostat
LN2 = np.log(2.0)


def mirostat_reference(logits: np.ndarray, version: int, mu: float, vocab: int) -> np.ndarray:
    """llama.cpp's mirostat truncation of one row (float64): the kept token ids, most likely first."""
    p = np.exp(logits - logits.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    ps = p[order]
    if version == 2:
        size = next((i for i, q in enumerate(ps) if -np.log2(q) > mu), len(ps))
        return order[:max(size, 1)]
    m = 100
    num = den = 0.0
    for i in range(min(m - 1, len(ps) - 1)):
        ti = np.log((i + 2) / (i + 1))
        num += ti * np.log(ps[i] / ps[i + 1])
        den += ti * ti
    s_hat = num / den
    eps = s_hat - 1
    k = ((eps * 2.0 ** mu) / (1 - vocab ** -eps)) ** (1 / s_hat)
    return order[:max(int(k), 1)]


def mirostat_rows(version: int, mus: list[float], temperature: float = 1.0, **knobs):
    from imp_jax.runtime.execution.sampling import RowSpec

    return [RowSpec(temperature=temperature, mirostat=version, mirostat_mu=mu, mirostat_tau=3.0, mirostat_eta=0.2,
                    seed=7, position=i, wants_top_logprobs=True, **knobs) for i, mu in enumerate(mus)]


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("dynamic_skips", [True, False])
def test_mirostat_keeps_llama_cpps_set_and_moves_mu_by_the_surprise(version: int, dynamic_skips: bool) -> None:
    """The tokens a mirostat row may draw (the finite entries of its processed top 20) are llama.cpp's set
    for its mu, the draw is one of them with its renormalised logprob, and the new mu is
    mu - eta * (-log2 p - tau); top_k, top_p, min_p and typical_p do not apply to mirostat rows."""
    import jax

    from imp_jax.runtime.execution.sampling import build_sampling_tensors, sample

    vocab = 600
    rng = np.random.default_rng(version)
    logits = (rng.standard_normal((6, vocab)) * 2.5).astype(np.float32)
    logits[:, :3] += 6                                      # a few likely tokens, a long tail
    mus = [0.5, 1.5, 2.5, 4.0, 6.0, 9.0] if version == 2 else [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    rows = mirostat_rows(version, mus, temperature=0.8, top_k=1, top_p=0.1, min_p=0.9)
    t = build_sampling_tensors(rows, num_rows_bucket=8, vocab_size=vocab, history_len=4, max_bias=2, with_mask=False)
    padded = np.concatenate([logits, np.zeros((2, vocab), np.float32)])
    out = sample(padded, t, jax.random.key(0), 20, dynamic_skips=dynamic_skips)
    sizes = []
    for r, mu in enumerate(mus):
        kept = mirostat_reference(logits[r].astype(np.float64) / 0.8, version, mu, vocab)
        sizes.append(len(kept))
        finite = set(np.asarray(out.top_ids[r])[np.isfinite(np.asarray(out.top_logprobs[r]))].tolist())
        if len(kept) <= 20:
            assert finite == set(kept.tolist()), (r, mu)
        else:
            assert len(finite) == 20 and finite <= set(kept.tolist())
        token = int(out.tokens[r])
        assert token in set(kept.tolist())
        p = np.exp(logits[r].astype(np.float64) / 0.8 - (logits[r] / 0.8).max())[kept]
        want_lp = np.log(p[kept.tolist().index(token)] / p.sum())
        assert float(out.logprob[r]) == pytest.approx(want_lp, abs=1e-4)
        assert float(out.mirostat_mu[r]) == pytest.approx(mu - 0.2 * (-want_lp / LN2 - 3.0), abs=1e-4)
    assert min(sizes) >= 1 and max(sizes) > 1 and len(set(sizes)) > 2   # the rows really differ
    assert np.asarray(out.mirostat_mu[6:]).tolist() == [0.0, 0.0]      # padding rows keep theirs


def test_a_greedy_mirostat_row_is_greedy_and_its_surprise_is_0() -> None:
    """At temperature 0 llama.cpp keeps one token: the argmax, surprise 0, so mu rises by eta * tau."""
    import jax

    from imp_jax.runtime.execution.sampling import build_sampling_tensors, sample

    logits = np.random.default_rng(1).standard_normal((2, 300)).astype(np.float32)
    rows = mirostat_rows(2, [4.0], temperature=0.0) + mirostat_rows(1, [4.0], temperature=0.0)
    t = build_sampling_tensors(rows, num_rows_bucket=2, vocab_size=300, history_len=4, max_bias=2, with_mask=False)
    out = sample(logits, t, jax.random.key(0), 0)
    assert np.asarray(out.tokens).tolist() == logits.argmax(-1).tolist()
    np.testing.assert_allclose(np.asarray(out.mirostat_mu), [4.0 + 0.2 * 3.0] * 2, rtol=1e-6)


def test_engine_carries_mu_from_step_to_step(tiny, monkeypatch) -> None:
    """Each step's row gets the mu the step before returned (first 2 * tau), which moved by that token's
    surprise (its reported logprob is the renormalised one); mirostat rows are never overlapped; the pool
    is back at baseline and nothing compiles."""
    core, _ = tiny
    baseline = core.stats()["num_free_blocks"]
    seen: list[float] = []
    real = core.inputs.row_spec

    def spy(seq, *a, **k):
        spec = real(seq, *a, **k)
        if spec.mirostat:
            seen.append(spec.mirostat_mu)
        return spec

    monkeypatch.setattr(core.inputs, "row_spec", spy)
    overlapped = core.counters.overlapped_steps
    events: list = []
    core.add_request(request(PROMPT, max_tokens=12, temperature=1.5, seed=11, ignore_eos=True, logprobs=0,
                             mirostat=2, mirostat_tau=2.0, mirostat_eta=0.5), events.append)
    while core.has_work():
        core.step()
    lps = [lp.logprob for e in events for lp in (e.logprobs or [])]
    assert len(lps) == 12 and len(seen) == 12
    mu = 4.0
    for k, lp in enumerate(lps):
        assert seen[k] == pytest.approx(mu, abs=1e-4), k
        mu = mu - 0.5 * (-lp / LN2 - 2.0)
    assert len(set(np.round(seen, 4))) > 3                      # mu really moved
    assert core.counters.overlapped_steps == overlapped
    assert core.stats()["num_free_blocks"] == baseline
    assert core.step_fn.compilations_after_warmup == 0


def test_engine_mirostat_with_a_tiny_target_is_greedy(tiny) -> None:
    """tau near 0 keeps mu near 0: v2 keeps the most likely token only, and v1's k is 1."""
    core, _ = tiny
    (greedy,) = run(core, request(PROMPT, max_tokens=8, **NEUTRAL))
    for version in (1, 2):
        (miro,) = run(core, request(PROMPT, max_tokens=8, **{**NEUTRAL, "temperature": 1.0}, seed=5,
                                    mirostat=version, mirostat_tau=0.01, mirostat_eta=0.01))
        assert miro == greedy, version
    (hot,) = run(core, request(PROMPT, max_tokens=8, **{**NEUTRAL, "temperature": 1.0}, seed=5,
                               mirostat=2, mirostat_tau=20.0))
    assert hot != greedy      # a high target leaves the tail in


MIRO_BAD = [("mirostat", 3), ("mirostat", -1), ("mirostat", "x"), ("mirostat_tau", 0), ("mirostat_tau", 101),
            ("mirostat_eta", 0), ("mirostat_eta", 1.5), ("mirostat_eta", "x")]


@pytest.mark.parametrize("route", ROUTES)
def test_mirostat_values_are_checked_on_every_route(fake_server, route: str) -> None:  # noqa: F811
    url, _ = fake_server
    for name, value in MIRO_BAD:
        r = httpx.post(url + route, json={**ROUTES[route], "mirostat": 2, name: value}, timeout=30)
        assert r.status_code == 400, (route, name, value, r.text)
        error = r.json()["error"]
        assert name in error["message"], (route, name, error)
        if route != "/v1/messages":
            assert error["param"] == name, error
    ok = {**ROUTES[route], "mirostat": 1, "mirostat_tau": 4.0, "mirostat_eta": 0.2}
    assert httpx.post(url + route, json=ok, timeout=30).status_code == 200
    off = {**ROUTES[route], "mirostat": 0, "mirostat_tau": -1}   # tau and eta act only through mirostat
    assert httpx.post(url + route, json=off, timeout=30).status_code == 200


@pytest.mark.real_model
def test_mirostat_through_the_clients(openai_client, live_server) -> None:  # noqa: F811
    import anthropic

    chat = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about cats."}], max_tokens=12, seed=3,
        extra_body={"mirostat": 2, "mirostat_tau": 4.0, "mirostat_eta": 0.1})
    assert chat.choices[0].message.content
    text = openai_client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8,
                                            extra_body={"mirostat": 1})
    assert text.choices[0].text
    claude = anthropic.Anthropic(base_url=live_server.url, api_key="x")
    msg = claude.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hi"}],
                                 extra_body={"mirostat": 2})
    assert msg.content[0].text
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hi"}],
                               extra_body={"mirostat": 2, "banned_strings": ["cat"]})
    assert "mirostat" in str(e.value)
    stats = wait_idle(live_server.url)
    assert stats["compilations_after_warmup"] == 0
