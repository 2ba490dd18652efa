"""Chat and Completions end to end through the official `openai` package, on the real engine and SmolLM2."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from support.servers import MODEL, LiveServer, live_server, openai_client, parse_sse  # noqa: F401

pytestmark = pytest.mark.real_model

QUESTION = [{"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Name three colours."}]
GREEDY = dict(model=MODEL, temperature=0, max_tokens=10)


def _chat_text(client: openai.OpenAI, **kw: object) -> str:
    return client.chat.completions.create(**{**GREEDY, "messages": QUESTION, **kw}).choices[0].message.content


def test_chat_completion(openai_client: openai.OpenAI) -> None:
    raw = openai_client.chat.completions.with_raw_response.create(**GREEDY, messages=QUESTION)
    r = raw.parse()
    assert r.id.startswith("chatcmpl-") and raw.headers["x-request-id"] == r.id
    assert r.object == "chat.completion" and r.model == MODEL
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length") and choice.logprobs is None
    assert 0 < r.usage.completion_tokens <= 10 and r.usage.prompt_tokens > 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens is not None


def test_chat_stream_equals_the_non_streamed_answer(openai_client: openai.OpenAI) -> None:
    expected = _chat_text(openai_client)
    chunks = list(openai_client.chat.completions.create(
        **GREEDY, messages=QUESTION, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_logprobs_of_a_greedy_answer(openai_client: openai.OpenAI) -> None:
    r = openai_client.chat.completions.create(**GREEDY, messages=QUESTION, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the sampled token is the top one
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    streamed = openai_client.chat.completions.create(**GREEDY, messages=QUESTION, logprobs=True, top_logprobs=1,
                                                     stream=True)
    tokens = [e.token for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert tokens == [e.token for e in content]


def test_developer_role_is_rendered_as_system(openai_client: openai.OpenAI) -> None:
    as_system = openai_client.chat.completions.create(**GREEDY, messages=QUESTION)
    as_developer = openai_client.chat.completions.create(
        **GREEDY, messages=[{"role": "developer", "content": QUESTION[0]["content"]}, QUESTION[1]])
    assert as_developer.usage.prompt_tokens == as_system.usage.prompt_tokens
    assert as_developer.choices[0].message.content == as_system.choices[0].message.content


def test_text_parts_equal_string_content(openai_client: openai.OpenAI) -> None:
    parts = [{"type": "text", "text": "Name three "}, {"type": "text", "text": "colours."}]
    r = openai_client.chat.completions.create(**GREEDY, messages=[QUESTION[0], {"role": "user", "content": parts}])
    assert r.choices[0].message.content == _chat_text(openai_client)


def test_continue_final_message_continues_the_assistant_text(live_server: LiveServer,
                                                             openai_client: openai.OpenAI) -> None:
    prefix = "Red, green and"
    r = openai_client.chat.completions.create(
        **GREEDY, messages=[*QUESTION, {"role": "assistant", "content": prefix}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    # The prompt is the render cut right after the prefix: the same ids as a completion on that text.
    head = httpx.post(live_server.url + "/tokenize", json={"messages": QUESTION}).json()["tokens"]
    tail = httpx.post(live_server.url + "/tokenize", json={"content": prefix}).json()["tokens"]
    assert r.usage.prompt_tokens == len(head) + len(tail)
    expected = openai_client.completions.create(**GREEDY, prompt=head + tail).choices[0].text
    assert r.choices[0].message.content == expected


def test_max_completion_tokens_and_ignore_eos(openai_client: openai.OpenAI) -> None:
    r = openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_completion_tokens=5,
                                              temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_stop_string_ends_the_answer_before_it(openai_client: openai.OpenAI) -> None:
    full = _chat_text(openai_client, max_tokens=16)
    words = full.split()
    assert len(words) >= 2, full
    stop = words[1]
    r = openai_client.chat.completions.create(**{**GREEDY, "max_tokens": 16}, messages=QUESTION, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].message.content
    assert full.startswith(r.choices[0].message.content)


def test_n_choices_and_seeded_sampling(openai_client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, messages=QUESTION, max_tokens=8, temperature=1.0, seed=11, n=2)
    a = openai_client.chat.completions.create(**kw)
    b = openai_client.chat.completions.create(**kw)
    other = openai_client.chat.completions.create(**{**kw, "seed": 12})
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.choices[0].message.content != a.choices[1].message.content  # each choice draws its own
    assert [c.message.content for c in other.choices] != [c.message.content for c in a.choices]  # the seed is used
    assert 2 <= a.usage.completion_tokens <= 16


def test_n_choices_stream_each_open_with_a_role_and_finish(live_server: LiveServer) -> None:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 6, "n": 3, "temperature": 1.0, "seed": 5,
            "stream": True, "stream_options": {"include_usage": True}}
    r = httpx.post(live_server.url + "/v1/chat/completions", json=body, timeout=120)
    frames = parse_sse(r.text)
    assert frames[-1] == (None, "[DONE]")
    chunks = [json.loads(d) for _, d in frames[:-1]]
    usage = chunks[-1]["usage"]
    per_choice = [c["choices"][0] for c in chunks if c["choices"]]
    roles = [c["index"] for c in per_choice if c["delta"].get("role") == "assistant"]
    finishes = [c["index"] for c in per_choice if c["finish_reason"]]
    assert sorted(roles) == sorted(finishes) == [0, 1, 2]
    assert 3 <= usage["completion_tokens"] <= 18 and not chunks[-1]["choices"]


def test_sampling_fields_are_accepted(openai_client: openai.OpenAI) -> None:
    r = openai_client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=6, temperature=0.7, top_p=0.9, presence_penalty=0.5,
        frequency_penalty=0.3, seed=3, user="tester",
        extra_body={"top_k": 40, "min_p": 0.05, "typical_p": 0.95, "repetition_penalty": 1.1, "priority": 2,
                    "cache_prompt": True})
    assert r.choices[0].message.content is not None


def test_logit_bias_forces_a_token(live_server: LiveServer, openai_client: openai.OpenAI) -> None:
    (token,) = httpx.post(live_server.url + "/tokenize", json={"content": " banana"}).json()["tokens"]
    r = openai_client.completions.create(**{**GREEDY, "max_tokens": 3}, prompt="I like", logit_bias={str(token): 100},
                                         logprobs=1)
    assert r.choices[0].text == " banana banana banana"
    assert r.choices[0].logprobs.tokens == [" banana"] * 3


def test_completion_and_its_stream(openai_client: openai.OpenAI) -> None:
    raw = openai_client.completions.with_raw_response.create(**GREEDY, prompt="The capital of France is")
    r = raw.parse()
    assert r.id.startswith("cmpl-") and raw.headers["x-request-id"] == r.id and r.object == "text_completion"
    assert r.choices[0].text and r.usage.completion_tokens > 0
    chunks = list(openai_client.completions.create(**GREEDY, prompt="The capital of France is", stream=True,
                                                   stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_completion_prompt_forms_agree(live_server: LiveServer, openai_client: openai.OpenAI) -> None:
    prompt = "Once upon a time"
    ids = httpx.post(live_server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    texts = {openai_client.completions.create(**GREEDY, prompt=p).choices[0].text
             for p in (prompt, [prompt], ids, [ids])}
    assert len(texts) == 1


def test_completion_legacy_logprobs(openai_client: openai.OpenAI) -> None:
    r = openai_client.completions.create(**GREEDY, prompt="One, two, three,", logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) <= 2 and max(top, key=top.get) == token


def test_completion_echo(openai_client: openai.OpenAI) -> None:
    prompt = "Roses are red,"
    plain = openai_client.completions.create(**GREEDY, prompt=prompt).choices[0].text
    echoed = openai_client.completions.create(**GREEDY, prompt=prompt, echo=True).choices[0].text
    assert echoed == prompt + plain
    stream = openai_client.completions.create(**GREEDY, prompt=prompt, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in stream) == prompt + plain


def test_completion_echo_with_logprobs_scores_the_prompt(openai_client: openai.OpenAI) -> None:
    prompt = "Roses are red, violets are"
    plain = openai_client.completions.create(**GREEDY, prompt=prompt, logprobs=2)
    echoed = openai_client.completions.create(**GREEDY, prompt=prompt, echo=True, logprobs=2)
    lp, gen = echoed.choices[0].logprobs, plain.choices[0].logprobs
    n_prompt = len(lp.tokens) - len(gen.tokens)
    assert n_prompt == echoed.usage.prompt_tokens and echoed.choices[0].text == prompt + plain.choices[0].text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:n_prompt])
    assert all(len(t) >= 1 for t in lp.top_logprobs[1:n_prompt])
    assert lp.tokens[n_prompt:] == gen.tokens and lp.token_logprobs[n_prompt:] == gen.token_logprobs
    assert "".join(lp.tokens[:n_prompt]) == prompt and lp.text_offset[n_prompt] == len(prompt)


def test_completion_prompt_logprobs(openai_client: openai.OpenAI) -> None:
    out = openai_client.completions.create(**GREEDY, prompt="The capital of France is",
                                           extra_body={"prompt_logprobs": 1})
    entries = out.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == out.usage.prompt_tokens and entries[0] is None
    for entry in entries[1:]:
        ranks = sorted(v["rank"] for v in entry.values())
        assert 1 <= len(entry) <= 2 and 1 in ranks
        assert all(v["logprob"] <= 0 and isinstance(v["decoded_token"], str) for v in entry.values())


def test_cached_prompt_tokens_are_reported(openai_client: openai.OpenAI) -> None:
    prompt = "A long shared prefix that spans a few KV blocks. " * 6
    openai_client.completions.create(**{**GREEDY, "max_tokens": 2}, prompt=prompt)
    again = openai_client.completions.create(**{**GREEDY, "max_tokens": 2}, prompt=prompt)
    assert again.usage.prompt_tokens_details.cached_tokens >= 32


def test_models_list_and_retrieve(openai_client: openai.OpenAI) -> None:
    (card,) = openai_client.models.list().data
    assert card.id == MODEL and card.model_extra["loaded"] is True and card.model_extra["max_model_len"] == 1024
    assert openai_client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("no-such-model")


def test_unknown_model_is_a_404_model_not_found(openai_client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        openai_client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
