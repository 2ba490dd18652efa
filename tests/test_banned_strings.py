"""banned_strings / banned_regex: the matcher (runtime/decoding/banned.py) on its own, then on SmolLM2 through the
engine (a banned phrase never comes out, the pool returns to its baseline, the 64-rewind cap) and through
the real server (streaming and not, and every 400 in each dialect's envelope)."""
from __future__ import annotations

import dataclasses

import anthropic
import openai
import pytest
from support.servers import MODEL, LiveServer, anthropic_for, live_server, openai_for  # noqa: F401
from support.engine import (
    BIG_POOL_BLOCKS,
    MAX_MODEL_LEN,
    TOKEN_BUDGET,
    make_engine,
    req,
    run,
)

from imp_jax.errors import InvalidRequestError
from imp_jax.runtime.decoding.banned import (
    MAX_REWINDS,
    REGEX_BUDGET_S,
    REGEX_S_PER_TOKEN,
    REGEX_SPENT,
    BannedFilter,
    BannedPhrases,
    RewindBudget,
    check_phrases,
    tail_chars,
)
from imp_jax.runtime.core.builder import enable_compilation_cache
from imp_jax.runtime.config import EngineConfig
from imp_jax.runtime.request import GenerationRequest, SamplingParams


# ------------------------------------------------------------------------------------------ matcher
def feed_tokens(f: BannedFilter, pieces: list[str]) -> tuple[list[int], str, int | None]:
    """Push `pieces` as tokens 0, 1, ... (token id = position); (released ids, released text, the position a
    completed phrase rewinds to, or None)."""
    ids, text = [], ""
    for i, piece in enumerate(pieces):
        f.push(i, i, None, (i,))
        at = f.feed(piece)
        if at is not None:
            return ids, text, f.rewind(at).position
        more, _, t = f.release()
        ids, text = ids + more, text + t
    return ids, text, None


def test_a_phrase_spanning_tokens_rewinds_to_the_token_it_starts_in() -> None:
    f = BannedFilter(BannedPhrases(["Paris"], []), RewindBudget())
    ids, text, at = feed_tokens(f, ["The", " capital", " is", " Pa", "ri", "s", "."])
    assert at == 3 and ids == [0, 1, 2] and text == "The capital is"   # " Pa" was held back
    assert f.bans == {3: [3]} and f.budget.left == MAX_REWINDS - 1
    assert f.flush() == ([], [], "")   # the held tokens from " Pa" on are gone with their text


def test_phrase_inside_one_token_and_leftmost_of_overlapping_phrases() -> None:
    f = BannedFilter(BannedPhrases(["cde", "bcdef", "xyz"], []), RewindBudget())
    _, _, at = feed_tokens(f, ["a", "b", "cdef"])
    assert at == 1   # "bcdef" starts left of "cde"; both complete in token 2
    g = BannedFilter(BannedPhrases(["cat"], []), RewindBudget())
    assert feed_tokens(g, ["con", "cat", "enate"])[2] == 1


def test_hold_back_amounts() -> None:
    strings = BannedPhrases(["hello world", "help"], [])
    assert strings.hold("say hel") == 3 and strings.hold("say hello w") == 7 and strings.hold("nothing") == 0
    assert strings.hold("hello worl") == 10 and strings.hold("say hello world!") == 0
    patterns = BannedPhrases([], ["x+y"])
    assert patterns.hold("a" * 300) == 255 and patterns.hold("abc") == 3
    assert patterns.hold("é" * 200) == 127   # 255 bytes of 2-byte characters
    assert tail_chars("a🙂", 4) == 1 and tail_chars("a🙂", 5) == 2


def test_release_is_whole_tokens_and_flush_gives_the_rest() -> None:
    f = BannedFilter(BannedPhrases(["wonderful"], []), RewindBudget())
    ids, text, at = feed_tokens(f, ["It", " is", " wo", "nder"])
    assert at is None and ids == [0, 1] and text == "It is"
    assert f.flush() == ([2, 3], [], " wonder")


def test_regex_leftmost_match_ending_in_new_text() -> None:
    f = BannedFilter(BannedPhrases([], [r"\d{3}-\d{4}", r"[A-Z]{4}"]), RewindBudget())
    _, _, at = feed_tokens(f, ["call ", "555", "-12", "34 ", "NOW"])
    assert at == 1
    # a match that ended in text already checked is not found again
    p = BannedPhrases([], ["ab"])
    assert p.find("xxab", 4) is None and p.find("xxab", 3) == 2
    # only the last 256 bytes are searched
    assert p.find("ab" + "z" * 300, 301) is None


def test_bans_are_per_position_and_the_budget_is_per_request() -> None:
    budget = RewindBudget(left=2)
    f = BannedFilter(BannedPhrases(["ab"], []), budget)
    assert feed_tokens(f, ["x", "a", "b"])[2] == 1
    f.bans[5] = [9]   # a ban further on belongs to a continuation a rewind discards
    f.push(1, 7, None, (1,))
    assert f.feed("a") is None
    f.push(2, 8, None, (2,))
    assert f.feed("b") == 0
    assert f.rewind(0).position == 1
    assert f.bans == {1: [1, 7]} and not f.active and budget.left == 0
    sibling = BannedFilter(f.phrases, budget)
    assert not sibling.active


@pytest.mark.parametrize("strings,patterns,param", [
    (["x"] * 65, [], "banned_strings"), ([""], [], "banned_strings"), (["é" * 129], [], "banned_strings"),
    ([], ["a"] * 17, "banned_regex"), ([], ["(unclosed"], "banned_regex"), ([], ["a*"], "banned_regex"),
    ([], ["x" * 257], "banned_regex"),
])
def test_limits_are_400s_naming_the_field(strings, patterns, param) -> None:
    with pytest.raises(InvalidRequestError) as e:
        check_phrases(strings, patterns)
    assert e.value.param == param
    check_phrases(["x"] * 64, ["é" * 128])   # at the limits


@pytest.mark.parametrize("pattern", ["(a+)+b", "(x+x+)+y", "(\\w+\\s?)+$", "(a|aa)*c", "(.*a){10}",
                                     "(?:\\D?){50}\\D{50}\\d", "(?=(a*)*)b"])
def test_backtracking_shapes_are_400s_naming_banned_regex(pattern) -> None:
    with pytest.raises(InvalidRequestError) as e:
        check_phrases([], [pattern])
    assert e.value.param == "banned_regex" and "backtrack" in str(e.value)


def test_safe_shapes_pass_admission() -> None:
    check_phrases([], ["(?:cat|dog)+", "\\d+-\\d+", "(?>a+)+b", "(ab|cd){2,5}", "\\p{L}+x", "a{1,3}b",
                       "(?:ab?)+c", "^(?:x|y)*z$"])


SLOW = "\\D*" * 8 + "\\d"   # polynomial backtracking (no nesting): passes admission, ~14 ms on 250 chars of prose


def test_slow_patterns_spend_the_request_budget_and_then_stop() -> None:
    """Each search stops at what the budget has left; once spent, the filter reports it (the engine then
    ends the request with REGEX_SPENT) and no further search runs."""
    check_phrases([], [SLOW])
    budget = RewindBudget()
    f = BannedFilter(BannedPhrases([], [SLOW] * 4), budget)
    import time
    t0 = time.perf_counter()
    for i in range(40):
        f.push(i, i, None, (i,))
        f.feed("a word, ")
        if f.out_of_time:
            break
    took = time.perf_counter() - t0
    assert f.out_of_time and budget.regex_s <= 0
    assert took < REGEX_BUDGET_S + 0.2, took   # bounded by the budget, not by 4 patterns x 40 tokens x 50 ms
    assert budget.left == MAX_REWINDS          # timeouts spend time, not rewinds
    sibling = BannedFilter(f.phrases, budget)
    assert sibling.out_of_time                 # the request's choices share it


def test_fast_patterns_refill_per_token_and_never_run_out() -> None:
    budget = RewindBudget(regex_s=REGEX_S_PER_TOKEN)
    f = BannedFilter(BannedPhrases([], ["ab+c", "x[0-9]+y"]), budget)
    for i in range(300):
        f.push(i, i, None, (i,))
        f.feed("word ")
        f.release()
        assert not f.out_of_time
    assert budget.regex_s > 0


# ------------------------------------------------------------------------------------------ engine
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def engine(smollm2_loaded, smollm2_gguf_path):
    """The same sizing as tests/test_engine.py's core (its programs are in the compilation cache)."""
    config = EngineConfig(model=str(smollm2_gguf_path), max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                          max_num_batched_tokens=TOKEN_BUDGET, num_kv_blocks=BIG_POOL_BLOCKS)
    enable_compilation_cache(config)
    return make_engine(smollm2_loaded, config, BIG_POOL_BLOCKS)


def chat_prompt(tok, question: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]), add_special_tokens=False)


@pytest.mark.real_model
def test_a_banned_phrase_never_comes_out_of_50_samples(engine) -> None:
    tok = engine.tokenizer
    prompt = chat_prompt(tok, QUESTION)
    sampled = {"temperature": 0.4, "max_tokens": 12, "n": 4, "logprobs": 1}
    control = run(engine, *[req(prompt, seed=10 * s, **sampled) for s in range(2)])
    texts = [c.text for r in control for c in r.choices.values()]
    assert sum("Paris" in t for t in texts) >= 4, texts   # the model often says it unless banned
    before = engine.stats()["banned_rewinds_total"]
    reqs = [req(prompt, seed=100 + 10 * s, banned_strings=["Paris"], banned_regex=[r"P\s*a\s*r\s*i\s*s"], **sampled)
            for s in range(13)]
    reqs[-1].params.n = 2
    results = run(engine, *reqs)   # the pool is back at its baseline (run checks)
    choices = [c for r in results for c in r.choices.values()]
    assert len(choices) == 50
    for c in choices:
        assert "Paris" not in c.text, c.text
        assert len(c.logprobs) == len(c.token_ids)   # held-back tokens come with their logprobs
        assert c.text == tok.decode(c.token_ids)   # rewinds restored the detokenizer: the text is the tokens'
    assert engine.stats()["banned_rewinds_total"] - before >= 6
    assert engine.step_fn.compilations_after_warmup == 0


@pytest.mark.real_model
def test_rewind_into_a_shared_prompt_block_and_async_scheduling(engine, monkeypatch) -> None:
    """A first token banned when the prompt fills whole blocks, the last pinned (cache_prompt) and so shared:
    the rewind recomputes that block instead of writing into it; the same with asynchronous scheduling."""
    tok = engine.tokenizer
    ids = tok.encode("Geography quiz. Question: which city is the capital of France? Answer: the capital is")
    bs = engine.config.block_size
    prompt = ids[len(ids) % bs:]
    assert len(prompt) % bs == 0 and len(prompt) >= bs
    control = req(prompt, max_tokens=3)
    control.cache_salt = "control"   # its blocks must not be the cached copies the banned runs find
    (plain,) = run(engine, control)
    assert "Paris" in plain.first.text   # what greedy says unbanned
    before = engine.stats()["banned_rewinds_total"]
    truncate, copies = engine.pool.truncate, []
    monkeypatch.setattr(engine.pool, "truncate", lambda *a: copies.append(truncate(*a)) or copies[-1])
    for async_on in (False, True):
        engine.async_scheduling = async_on
        try:
            banned = req(prompt, max_tokens=6, n=2, cache_prompt=True, banned_strings=["Paris"])
            banned.cache_salt = f"async {async_on}"   # its prompt block pinned (cache_prompt) is its own
            (res,) = run(engine, banned)
        finally:
            engine.async_scheduling = False
        assert all("Paris" not in c.text and c.text == tok.decode(c.token_ids) for c in res.choices.values())
    assert engine.stats()["banned_rewinds_total"] - before >= 4
    assert any(c is not None for c in copies)   # the pinned tail block was swapped, its tokens recomputed
    assert engine.step_fn.compilations_after_warmup == 0


@pytest.mark.real_model
def test_stop_strings_apply_to_the_released_text(engine) -> None:
    tok = engine.tokenizer
    prompt = chat_prompt(tok, QUESTION)
    (plain,) = run(engine, req(prompt, max_tokens=8))
    assert plain.first.text.startswith("The capital of France is Paris")
    (res,) = run(engine, req(prompt, max_tokens=8, stop=[" is"], banned_strings=["Paris", "France is"]))
    c = res.first   # "France is" is rewound, so greedy goes another way; " is" still ends what is kept
    assert c.text.startswith("The capital of") and "France is" not in c.text and "Paris" not in c.text
    assert (c.finish_reason, c.stop_reason) == ("stop", " is"), c.text   # greedy: "... the French Republic is"


@pytest.mark.real_model
def test_rewind_cap_lets_phrases_pass(engine) -> None:
    tok = engine.tokenizer
    prompt = chat_prompt(tok, QUESTION)
    before = engine.stats()["banned_rewinds_total"]
    (res,) = run(engine, req(prompt, max_tokens=40, ignore_eos=True, n=2, temperature=0.5, seed=3,
                             banned_strings=["e", "a", "o", "i", "s"]))
    assert engine.stats()["banned_rewinds_total"] - before == MAX_REWINDS   # per request, over its choices
    assert any(ch in c.text for c in res.choices.values() for ch in "eaois")


@pytest.mark.real_model
def test_a_request_whose_patterns_spend_their_time_ends_with_an_error(engine) -> None:
    prompt = chat_prompt(engine.tokenizer, QUESTION)
    (res,) = run(engine, req(prompt, max_tokens=64, ignore_eos=True, n=2, banned_regex=[SLOW] * 16))
    ends = [ev for ev in res.events if ev.finish_reason]   # run() checked the pool is back at its baseline
    assert len(ends) == 2 and all(ev.finish_reason == "error" and ev.error == REGEX_SPENT for ev in ends)
    assert ends[0].extra == {"code": "regex_time_spent", "param": "banned_regex"}
    assert all(len(c.token_ids) < 64 for c in res.choices.values())


@pytest.mark.real_model
def test_engine_refuses_what_a_rewind_cannot_undo(engine) -> None:
    params = SamplingParams(max_tokens=4, banned_strings=["x"])
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request(GenerationRequest("c", [1, 2, 3], params, constraint='start: "x"'), lambda ev: None)
    assert e.value.param == "banned_strings"
    miro = dataclasses.replace(params, banned_strings=[], banned_regex=["y+"], mirostat=2)
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request(GenerationRequest("m", [1, 2, 3], miro), lambda ev: None)
    assert e.value.param == "banned_regex" and "mirostat" in str(e.value)
    assert not engine.requests


# ------------------------------------------------------------------------------------------ server
@pytest.fixture(scope="module")
def oai(live_server: LiveServer) -> openai.OpenAI:  # noqa: F811
    return openai_for(live_server.url)


@pytest.fixture(scope="module")
def claude(live_server: LiveServer) -> anthropic.Anthropic:  # noqa: F811
    return anthropic_for(live_server.url)


BAN = {"banned_strings": ["Paris"], "temperature": 0.8}
ASK = [{"role": "user", "content": QUESTION}]


@pytest.mark.real_model
def test_server_routes_never_send_a_banned_phrase(oai, claude, live_server) -> None:  # noqa: F811
    from support.servers import wait_idle
    chat = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, n=4, seed=1, logprobs=True,
                                       extra_body=BAN)
    assert all("Paris" not in c.message.content for c in chat.choices)
    assert sum(len(c.logprobs.content) for c in chat.choices) == chat.usage.completion_tokens   # held ones too
    stream = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, n=4, seed=2, stream=True,
                                         extra_body=BAN)
    texts = ["", "", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert all(texts) and all("Paris" not in t for t in texts), texts
    done = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, seed=3,
                                  stream=True, extra_body={**BAN, "banned_regex": ["Par(is)?"]})
    assert "Par" not in "".join(c.choices[0].text for c in done)
    r = oai.responses.create(model=MODEL, input=QUESTION, max_output_tokens=12, extra_body=BAN)
    assert "Paris" not in r.output_text
    m = claude.messages.create(model=MODEL, max_tokens=12, messages=ASK, extra_body=BAN)
    assert "Paris" not in m.content[0].text
    stats = wait_idle(live_server.url)
    assert stats["banned_rewinds_total"] > 0
    assert "imp_banned_rewinds_total" in __import__("httpx").get(live_server.url + "/metrics").text


@pytest.mark.real_model
def test_spent_regex_time_is_a_400_naming_banned_regex(oai, live_server) -> None:  # noqa: F811
    from support.servers import wait_idle
    slow = {"banned_regex": [SLOW] * 16, "ignore_eos": True}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, extra_body=slow)
    assert e.value.body["param"] == "banned_regex" and e.value.body["code"] == "regex_time_spent"
    with pytest.raises(openai.APIError) as e:
        for _ in oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, stream=True, extra_body=slow):
            pass
    assert "regex time budget" in str(e.value)
    assert wait_idle(live_server.url)["num_running"] == 0


SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
BAD = [
    ({"banned_strings": "Paris"}, "banned_strings"),
    ({"banned_strings": ["x"] * 65}, "banned_strings"),
    ({"banned_strings": ["y" * 257]}, "banned_strings"),
    ({"banned_regex": ["(open"]}, "banned_regex"),
    ({"banned_regex": ["x?"]}, "banned_regex"),
    ({"banned_regex": ["a"] * 17}, "banned_regex"),
]


@pytest.mark.real_model
@pytest.mark.parametrize("body,param", BAD + [
    ({"banned_strings": ["x"], "response_format": SCHEMA}, "banned_strings"),
    ({"banned_regex": ["x"], "tools": [TOOL], "tool_choice": "required"}, "banned_regex"),
])
def test_openai_400s(oai, body, param) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, extra_body=body)
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"
    if "response_format" not in body and "tools" not in body:
        with pytest.raises(openai.BadRequestError) as e:
            oai.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body=body)
        assert e.value.body["param"] == param
        with pytest.raises(openai.BadRequestError) as e:
            oai.responses.create(model=MODEL, input="hi", max_output_tokens=2, extra_body=body)
        assert e.value.body["param"] == param


@pytest.mark.real_model
@pytest.mark.parametrize("body,param", BAD + [
    ({"banned_strings": ["x"], "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {}}}],
      "tool_choice": {"type": "any"}}, "banned_strings"),
])
def test_anthropic_400s(claude, body, param) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=2, messages=ASK, extra_body=body)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert param in e.value.body["error"]["message"]
