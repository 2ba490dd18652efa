"""Anthropic Messages end to end: the official `anthropic` package on the real engine (SmolLM2), raw 400s, and
faults and pings over FakeEngine."""
from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import anthropic
import httpx
import pytest
from support.servers import (FAULT_MARKER, MODEL, FakeEngine, LiveServer, fake_server, live_server,  # noqa: F401
                             parse_sse)

from imp_jax.server import anthropic_messages

PNG_1PX = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"   # a 1x1 red PNG

real = pytest.mark.real_model
SYSTEM = "You are a terse assistant."
QUESTION = [{"role": "user", "content": "Name three colours."}]
PATH = "/v1/messages"


def greedy(max_tokens: int = 10, system: Any = SYSTEM, **extra_body: Any) -> dict[str, Any]:
    """SDK kwargs for a greedy answer. This SDK has no sampling parameters: they travel in extra_body."""
    return dict(model=MODEL, max_tokens=max_tokens, system=system, extra_body={"temperature": 0, **extra_body})


GREEDY = greedy()


@pytest.fixture(scope="module")
def anthropic_client(live_server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live_server.url, api_key="unused", max_retries=0, timeout=300)


def _text(message: Any) -> str:
    (block,) = message.content
    assert block.type == "text"
    return block.text


def _count(client: anthropic.Anthropic, **kw: Any) -> int:
    return client.messages.count_tokens(**{"model": MODEL, "system": SYSTEM, "messages": QUESTION, **kw}).input_tokens


# --------------------------------------------------------------------------- the real engine, through the SDK
@real
@pytest.mark.parametrize("extra", [
    {"max_tokens": 20},                                                       # end_turn
    {"max_tokens": 3},                                                        # max_tokens
    {"max_tokens": 40, "tool_choice": {"type": "any"}, "tools": [{"name": "get_weather", "description": "weather",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]},
], ids=["end_turn", "max_tokens", "tool_use"])
def test_every_event_and_the_whole_message_pass_the_sdks_strict_validation(live_server: LiveServer,
                                                                             extra: dict[str, Any]) -> None:
    """As for Responses: the anthropic client validates each event strictly before it falls back to building
    it unchecked by `type`, a path that races between threads; `ping` is not in its union (the SDK skips it)."""
    from anthropic._models import validate_type
    from anthropic.types import Message, RawMessageStreamEvent
    body = {"model": MODEL, "temperature": 0, "messages": [{"role": "user", "content": "Weather in Paris?"}], **extra}
    whole = httpx.post(live_server.url + PATH, json=body, timeout=120)
    assert validate_type(type_=Message, value=whole.json()).id == whole.json()["id"]
    with httpx.stream("POST", live_server.url + PATH, json={**body, "stream": True}, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events][-1] == "message_stop"
    for ev in events:
        if ev["type"] != "ping":
            assert not isinstance(validate_type(type_=RawMessageStreamEvent, value=ev), dict), ev["type"]


@real
def test_message(anthropic_client: anthropic.Anthropic) -> None:
    raw = anthropic_client.messages.with_raw_response.create(**GREEDY, messages=QUESTION)
    m = raw.parse()
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert _text(m) and m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert raw.headers["request-id"] == m.id and raw.headers["x-request-id"] == m.id
    sent = raw.http_response.request.headers["anthropic-version"]  # the SDK sends it; the server echoes it
    assert sent and raw.headers["anthropic-version"] == sent
    u = m.usage
    assert 0 < u.output_tokens <= 10 and u.cache_creation_input_tokens == 0
    assert u.input_tokens + u.cache_read_input_tokens == _count(anthropic_client)


@real
def test_stream_helper_equals_the_whole_message(anthropic_client: anthropic.Anthropic) -> None:
    whole = anthropic_client.messages.create(**GREEDY, messages=QUESTION)
    with anthropic_client.messages.stream(**GREEDY, messages=QUESTION) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == _text(whole) == _text(final)
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.id.startswith("msg_") and final.id != whole.id


@real
def test_create_stream_event_sequence(anthropic_client: anthropic.Anthropic) -> None:
    events = list(anthropic_client.messages.create(**GREEDY, messages=QUESTION, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) <= {"content_block_delta"} and len(kinds) > 5
    start, delta = events[0].message, events[-2]
    assert start.content == [] and start.stop_reason is None and start.usage.output_tokens == 0
    assert delta.delta.stop_reason in ("end_turn", "max_tokens") and 0 < delta.usage.output_tokens <= 10
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == _text(anthropic_client.messages.create(**GREEDY, messages=QUESTION))


@real
def test_raw_stream_pings_after_message_start_and_carries_ids(live_server: LiveServer) -> None:
    body = {"model": MODEL, "max_tokens": 10, "system": SYSTEM, "temperature": 0, "messages": QUESTION,
            "stream": True}
    r = httpx.post(live_server.url + PATH, json=body, headers={"anthropic-beta": "tools-2024-04-04"}, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = parse_sse(r.text)
    assert [e for e, _ in frames[:3]] == ["message_start", "ping", "content_block_start"]
    for event, data in frames:
        assert json.loads(data)["type"] == event
    assert r.headers["request-id"] == json.loads(frames[0][1])["message"]["id"]
    assert r.headers["anthropic-beta"] == "tools-2024-04-04"


@real
def test_system_blocks_equal_a_system_string(anthropic_client: anthropic.Anthropic) -> None:
    plain = anthropic_client.messages.create(**GREEDY, messages=QUESTION)
    blocks = anthropic_client.messages.create(**greedy(system=[{"type": "text", "text": SYSTEM}]),
                                              messages=[{"role": "user", "content": [
                                                  {"type": "text", "text": QUESTION[0]["content"]}]}])
    assert _text(blocks) == _text(plain)
    assert _count(anthropic_client, system=[{"type": "text", "text": SYSTEM}]) == _count(anthropic_client)


@real
def test_consecutive_turns_of_one_role_are_combined(anthropic_client: anthropic.Anthropic) -> None:
    split = [{"role": "user", "content": "Name three"},
             {"role": "user", "content": [{"type": "text", "text": "colours."}]}]
    joined = [{"role": "user", "content": "Name three\ncolours."}]
    assert _count(anthropic_client, messages=split) == _count(anthropic_client, messages=joined)
    a = anthropic_client.messages.create(**GREEDY, messages=split)
    b = anthropic_client.messages.create(**GREEDY, messages=joined)
    assert _text(a) == _text(b)


@real
def test_trailing_assistant_turn_is_a_prefill(live_server: LiveServer, anthropic_client: anthropic.Anthropic) -> None:
    prefix = "Red, green and"
    m = anthropic_client.messages.create(**GREEDY, messages=[*QUESTION, {"role": "assistant", "content": prefix}])
    head = httpx.post(live_server.url + "/tokenize", json={"messages": [
        {"role": "system", "content": SYSTEM}, *QUESTION]}).json()["tokens"]
    tail = httpx.post(live_server.url + "/tokenize", json={"content": prefix}).json()["tokens"]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(head) + len(tail)
    expected = httpx.post(live_server.url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": head + tail, "temperature": 0, "max_tokens": 10}).json()["choices"][0]["text"]
    assert _text(m) == expected and not _text(m).startswith(prefix)
    # an empty final assistant turn is no prefill: the answer is the plain one
    empty = anthropic_client.messages.create(**GREEDY, messages=[*QUESTION, {"role": "assistant", "content": ""}])
    assert _text(empty) == _text(anthropic_client.messages.create(**GREEDY, messages=QUESTION))


@real
def test_stop_sequence_ends_the_answer_before_it(anthropic_client: anthropic.Anthropic) -> None:
    full = _text(anthropic_client.messages.create(**greedy(16), messages=QUESTION))
    words = full.split()
    assert len(words) >= 2, full
    m = anthropic_client.messages.create(**greedy(16), messages=QUESTION, stop_sequences=[words[1]])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == words[1]
    assert words[1] not in _text(m) and full.startswith(_text(m))
    with anthropic_client.messages.stream(**greedy(16), messages=QUESTION, stop_sequences=[words[1]]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == words[1] and _text(final) == _text(m)


@real
def test_max_tokens_and_ignore_eos(anthropic_client: anthropic.Anthropic) -> None:
    m = anthropic_client.messages.create(**greedy(5, ignore_eos=True), messages=QUESTION)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 5


@real
def test_extension_fields_and_metadata_are_accepted(anthropic_client: anthropic.Anthropic) -> None:
    kw = dict(model=MODEL, max_tokens=8, messages=QUESTION, metadata={"user_id": "tester"},
              cache_control={"type": "ephemeral"}, output_config={"effort": "low"},
              extra_body={"temperature": 1.0, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "typical_p": 0.95,
                          "presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.1, "seed": 7,
                          "priority": 2, "cache_prompt": True})
    a, b = anthropic_client.messages.create(**kw), anthropic_client.messages.create(**kw)
    assert _text(a) == _text(b)  # seeded: the same draw twice
    other = anthropic_client.messages.create(**{**kw, "extra_body": {**kw["extra_body"], "seed": 8}})
    assert _text(other) != _text(a)  # ... and the seed is what decides it
    # top_k is read: with one candidate left, sampling at temperature 1 is the greedy answer
    top1 = anthropic_client.messages.create(**greedy(8, temperature=1.0, top_k=1, seed=9), messages=QUESTION)
    assert _text(top1) == _text(anthropic_client.messages.create(**greedy(8), messages=QUESTION))
    # cache_prompt and priority are taken: the second identical prompt reads the first's cached blocks
    assert b.usage.cache_read_input_tokens > 0


@real
def test_logit_bias_forces_a_token(live_server: LiveServer, anthropic_client: anthropic.Anthropic) -> None:
    (token,) = httpx.post(live_server.url + "/tokenize", json={"content": " banana"}).json()["tokens"]
    m = anthropic_client.messages.create(**greedy(3, logit_bias={str(token): 100}), messages=QUESTION)
    assert _text(m) == " banana banana banana"


@real
def test_prefix_cache_hits_are_cache_reads(anthropic_client: anthropic.Anthropic) -> None:
    system = [{"type": "text", "text": "A long shared system prompt that spans a few KV blocks. " * 6,
               "cache_control": {"type": "ephemeral"}}]
    anthropic_client.messages.create(**greedy(2, system=system), messages=QUESTION)
    again = anthropic_client.messages.create(**greedy(2, system=system), messages=QUESTION)
    assert again.usage.cache_read_input_tokens >= 32
    total = anthropic_client.messages.count_tokens(model=MODEL, system=system, messages=QUESTION).input_tokens
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == total


@real
def test_errors_through_the_sdk(anthropic_client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_client.messages.create(**greedy(temperature=1.5), messages=QUESTION)
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert info.value.request_id and info.value.body["request_id"] == info.value.request_id
    with pytest.raises(anthropic.NotFoundError) as info:
        anthropic_client.messages.create(**{**GREEDY, "model": "claude-sonnet-4-5"}, messages=QUESTION)
    assert info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        anthropic_client.messages.count_tokens(model=MODEL, messages=[])


# --------------------------------------------------------------------------- every validation rule, raw
BODY: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
_DROP = object()


def _with(**changes: Any) -> dict[str, Any]:
    return {k: v for k, v in {**BODY, **changes}.items() if v is not _DROP}


def _user(content: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


CASES: dict[str, tuple[dict[str, Any], str | None]] = {
    "max_tokens_missing": (_with(max_tokens=_DROP), "max_tokens"),
    "max_tokens_zero": (_with(max_tokens=0), "max_tokens"),
    "max_tokens_float": (_with(max_tokens=2.5), "max_tokens"),
    "max_tokens_string": (_with(max_tokens="4"), "max_tokens"),
    "model_missing": (_with(model=_DROP), "model"),
    "model_number": (_with(model=3), "model"),
    "messages_missing": (_with(messages=_DROP), "messages"),
    "messages_empty": (_with(messages=[]), "messages"),
    "messages_string": (_with(messages="hi"), "messages"),
    "message_not_object": (_with(messages=["hi"]), "messages[0]"),
    "role_system": (_with(messages=[{"role": "system", "content": "hi"}]), "messages[0].role"),
    "role_tool": (_with(messages=[{"role": "tool", "content": "hi"}]), "messages[0].role"),
    "role_missing": (_with(messages=[{"content": "hi"}]), "messages[0].role"),
    "content_missing": (_with(messages=[{"role": "user"}]), "messages[0].content"),
    "content_number": (_with(messages=_user(5)), "messages[0].content"),
    "content_empty_string": (_with(messages=_user("")), "messages[0].content"),
    "content_empty_list": (_with(messages=_user([])), "messages[0].content"),
    "middle_assistant_empty": (_with(messages=[*_user("a"), {"role": "assistant", "content": ""}, *_user("b")]),
                               "messages[1].content"),
    "image_block_not_an_image": (_with(messages=_user([{"type": "text", "text": "see"}, {"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AA=="}}])), "messages[0].content[1].source.data"),
    "image_block_no_vision": (_with(messages=_user([{"type": "text", "text": "see"}, {"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": PNG_1PX}}])), "messages[0].content[1]"),
    "tool_use_block_without_input": (_with(messages=[*_user("a"), {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f"}]}]), "messages[1].content[0].input"),
    "text_block_without_text": (_with(messages=_user([{"type": "text"}])), "messages[0].content[0].text"),
    "text_block_number": (_with(messages=_user([{"type": "text", "text": 5}])), "messages[0].content[0].text"),
    "system_number": (_with(system=5), "system"),
    "system_image_block": (_with(system=[{"type": "image", "source": {}}]), "system[0].type"),
    "temperature_above_one": (_with(temperature=1.5), "temperature"),
    "temperature_negative": (_with(temperature=-0.5), "temperature"),
    "temperature_string": (_with(temperature="warm"), "temperature"),
    "top_p_zero": (_with(top_p=0), "top_p"),
    "top_p_above_one": (_with(top_p=1.5), "top_p"),
    "top_k_string": (_with(top_k="5"), "top_k"),
    "top_k_overflow": (_with(top_k=2**40), "top_k"),
    "min_p_above_one": (_with(min_p=1.5), "min_p"),
    "typical_p_zero": (_with(typical_p=0), "typical_p"),
    "presence_penalty": (_with(presence_penalty=3), "presence_penalty"),
    "frequency_penalty": (_with(frequency_penalty=-3), "frequency_penalty"),
    "repetition_penalty_zero": (_with(repetition_penalty=0), "repetition_penalty"),
    "seed_string": (_with(seed="7"), "seed"),
    "logit_bias_value": (_with(logit_bias={"5": 101}), "logit_bias"),
    "logit_bias_outside_vocab": (_with(logit_bias={"49152": 1}), "logit_bias"),
    "ignore_eos_string": (_with(ignore_eos="yes"), "ignore_eos"),
    "priority_string": (_with(priority="high"), "priority"),
    "cache_prompt_string": (_with(cache_prompt="yes"), "cache_prompt"),
    "stop_sequences_string": (_with(stop_sequences="END"), "stop_sequences"),
    "stop_sequences_empty_string": (_with(stop_sequences=[""]), "stop_sequences"),
    "stop_sequences_too_many": (_with(stop_sequences=[f"s{i}" for i in range(17)]), "stop_sequences"),
    "stop_is_not_a_messages_field": (_with(stop=["x"]), "stop"),
    "n_two": (_with(n=2), "n"),
    "stream_string": (_with(stream="yes"), "stream"),
    "metadata_string": (_with(metadata="me"), "metadata"),
    "metadata_user_id_number": (_with(metadata={"user_id": 5}), "metadata.user_id"),
    "tool_choice_names_no_tool": (_with(tools=[{"name": "f", "input_schema": {"type": "object"}}],
                                        tool_choice={"type": "tool", "name": "g"}), "tool_choice"),
    "thinking_type": (_with(thinking={"type": "sometimes"}), "thinking.type"),
    "thinking_budget_missing": (_with(thinking={"type": "enabled"}), "thinking.budget_tokens"),
    "output_format_unenforceable": (_with(output_config={"format": {"type": "json_schema", "schema": {"not": {}}}}),
                                    "output_config.format.schema"),
    "cache_control_string": (_with(cache_control="ephemeral"), "cache_control"),
    "prompt_past_context": (_with(messages=_user("go " * 1100)), None),  # context_length_exceeded
}


@real
@pytest.mark.parametrize("name", list(CASES))
def test_invalid_request_is_a_400_in_the_anthropic_envelope(live_server: LiveServer, name: str) -> None:
    body, param = CASES[name]
    r = httpx.post(live_server.url + PATH, json=body, timeout=60)
    assert r.status_code == 400, r.text
    rid = r.headers["request-id"]
    err = r.json()
    assert set(err) == {"type", "error", "request_id"} and err["type"] == "error" and err["request_id"] == rid
    assert set(err["error"]) == {"type", "message"} and err["error"]["type"] == "invalid_request_error"
    assert param is None or f"'{param}'" in err["error"]["message"], err


COUNT_CASES: dict[str, tuple[dict[str, Any], str | None]] = {
    "messages_missing": ({"model": MODEL}, "messages"),
    "messages_empty": ({"model": MODEL, "messages": []}, "messages"),
    "bad_role": ({"model": MODEL, "messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
    "image_block": ({"model": MODEL, "messages": _user([{"type": "image", "source": {}}])},
                    "messages[0].content[0].source.type"),
    "image_block_no_vision": ({"model": MODEL, "messages": _user([{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": PNG_1PX}}])}, "messages[0].content[0]"),
}


@real
@pytest.mark.parametrize("name", list(COUNT_CASES))
def test_count_tokens_validates_like_messages(live_server: LiveServer, name: str) -> None:
    body, param = COUNT_CASES[name]
    r = httpx.post(live_server.url + PATH + "/count_tokens", json=body)
    assert r.status_code == 400 and r.json()["type"] == "error" and f"'{param}'" in r.json()["error"]["message"]


@real
@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]"])
def test_malformed_json_is_an_anthropic_400(live_server: LiveServer, raw: bytes) -> None:
    r = httpx.post(live_server.url + PATH, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["request_id"] == r.headers["request-id"]


@real
def test_envelopes_and_headers_on_every_answer(live_server: LiveServer) -> None:
    url = live_server.url
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "prompt-caching-2024-07-31,foo-2025"}
    for method, path, body, status, kind in [
        ("POST", PATH, {**BODY, "model": "claude-3-haiku"}, 404, "not_found_error"),
        ("POST", PATH, {**BODY, "max_tokens": 0}, 400, "invalid_request_error"),
        ("GET", PATH, None, 405, "invalid_request_error"),
        ("POST", PATH + "/nothing", {}, 404, "not_found_error"),
        ("POST", PATH + "/count_tokens", {"model": MODEL, "messages": _user("hi")}, 200, None),
    ]:
        r = httpx.request(method, url + path, json=body, headers=headers, timeout=60)
        assert r.status_code == status, (path, r.text)
        assert r.headers["anthropic-version"] == "2023-06-01"
        assert r.headers["anthropic-beta"] == headers["anthropic-beta"]
        assert r.headers["request-id"].startswith("req_")
        if kind is not None:
            assert r.json() == {"type": "error", "error": {"type": kind, "message": r.json()["error"]["message"]},
                                "request_id": r.headers["request-id"]}
    r = httpx.post(url + PATH, json=BODY, headers={"X-Request-Id": "trace-7"}, timeout=60)
    assert r.status_code == 200 and r.headers["request-id"] == "trace-7" and r.json()["id"].startswith("msg_")
    assert "anthropic-version" not in httpx.post(url + "/v1/chat/completions", json={}, headers=headers).headers
    assert "foo-2025" in live_server.log_text()  # an unknown beta is logged (once)


# --------------------------------------------------------------------------- FakeEngine: faults and pings
FAKE = {"model": "fake-model", "max_tokens": 6, "messages": [{"role": "user", "content": "hi"}]}


def test_fault_mid_stream_ends_with_an_error_event(fake_server: tuple[str, FakeEngine]) -> None:
    url, _ = fake_server
    body = {**FAKE, "messages": _user(f"please {FAULT_MARKER}"), "stream": True}
    r = httpx.post(url + PATH, json=body, timeout=30)
    frames = parse_sse(r.text)
    assert [e for e, _ in frames[:3]] == ["message_start", "ping", "content_block_start"]
    event, data = frames[-1]
    assert event == "error" and "message_stop" not in [e for e, _ in frames]
    err = json.loads(data)
    assert err["type"] == "error" and err["error"]["type"] == "api_error" and "injected" in err["error"]["message"]
    assert err["request_id"] == r.headers["request-id"]
    text = "".join(json.loads(d)["delta"]["text"] for e, d in frames if e == "content_block_delta")
    assert text == "The quick"
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.APIStatusError, match="injected"):
        with client.messages.stream(**{**FAKE, "messages": _user(f"please {FAULT_MARKER}")}) as stream:
            stream.get_final_message()


def test_fault_without_streaming_is_a_500_api_error(fake_server: tuple[str, FakeEngine]) -> None:
    url, _ = fake_server
    r = httpx.post(url + PATH, json={**FAKE, "messages": _user(FAULT_MARKER)}, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["type"] == "api_error"


def test_pings_keep_a_silent_stream_alive(fake_server: tuple[str, FakeEngine], monkeypatch: pytest.MonkeyPatch) -> None:
    url, engine = fake_server
    monkeypatch.setattr(anthropic_messages, "PING_INTERVAL_S", 0.05)
    monkeypatch.setattr(engine, "token_delay", 0.3)
    r = httpx.post(url + PATH, json={**FAKE, "max_tokens": 3, "stream": True}, timeout=30)
    kinds = [e for e, _ in parse_sse(r.text)]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds.count("ping") >= 4 and kinds[-1] == "message_stop"
    between = kinds[kinds.index("content_block_start") + 1:kinds.index("content_block_stop")]
    assert "ping" in between and between.count("content_block_delta") == 3


def test_max_tokens_past_the_context_is_cut_to_it(fake_server: tuple[str, FakeEngine]) -> None:
    """Agents send max_tokens=32000 whatever the model: the answer ends where the context (here 256) does."""
    url, engine = fake_server
    messages = _user("hello world " * 30)
    prompt = httpx.post(url + PATH + "/count_tokens", json={"model": "fake-model", "messages": messages}).json()
    room = engine.max_model_len - prompt["input_tokens"]
    assert 0 < room < 200, room
    r = httpx.post(url + PATH, json={**FAKE, "max_tokens": 32000, "messages": messages}, timeout=30).json()
    assert r["stop_reason"] == "model_context_window_exceeded" and r["usage"]["output_tokens"] == room
    r = httpx.post(url + "/v1/responses", json={"model": "fake-model", "input": messages[0]["content"],
                                                "max_output_tokens": 32000}, timeout=30).json()
    assert r["status"] == "incomplete" and r["usage"]["output_tokens"] == room
    assert r["incomplete_details"] == {"reason": "max_output_tokens"}


# ------------------------------------------------------------------ structured output, cache breakpoints
OK_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}


def test_output_format_constrains_the_reply(live_server: LiveServer) -> None:
    """The structured-outputs beta's top-level `output_format` is enforced like output_config.format."""
    body = {"model": MODEL, "max_tokens": 20, "messages": [{"role": "user", "content": "Is water wet?"}],
            "output_format": {"type": "json_schema", "schema": OK_SCHEMA}}
    r = httpx.post(live_server.url + PATH, json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["content"][0]["text"])["ok"], bool)
    both = {**body, "output_config": {"format": {"type": "json_schema", "schema": OK_SCHEMA}}}
    for bad, field in ((both, "output_format"), ({**body, "output_format": {"type": "json_schema"}},
                                                 "output_format.schema"),
                       ({**body, "response_format": {"type": "json_object"}}, "response_format")):
        r = httpx.post(live_server.url + PATH, json=bad, timeout=60)
        assert r.status_code == 400 and f"'{field}'" in r.json()["error"]["message"], r.text


def test_cache_control_pins_up_to_the_last_breakpoint() -> None:
    from imp_jax.server.anthropic_messages import MessagesRequest
    from imp_jax.server.prompts import breakpoint_tokens, messages_prompt
    from support.servers import fake_tokenizer

    tok = fake_tokenizer()
    engine = SimpleNamespace(tokenizer=tok)   # prompt building reads only the engine's tokenizer (no images here)
    mark = {"type": "ephemeral"}
    body = {"model": MODEL, "max_tokens": 5,
            "system": [{"type": "text", "text": "You are terse.", "cache_control": mark}],
            "messages": [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "hi"},
                         {"role": "user", "content": "the quick brown fox"}]}
    req = MessagesRequest.model_validate(body)
    ids = messages_prompt(req, engine)[0]
    n = breakpoint_tokens(req, engine, ids)
    assert tok.decode(ids[:n], skip_special_tokens=False) == "<|im_start|>system\nYou are terse.<|im_end|>\n"
    body["messages"][0]["content"] = [{"type": "text", "text": "hello world", "cache_control": mark}]
    req = MessagesRequest.model_validate(body)
    n = breakpoint_tokens(req, engine, ids)
    assert tok.decode(ids[:n], skip_special_tokens=False).endswith("hello world<|im_end|>\n") and n < len(ids)
    assert breakpoint_tokens(MessagesRequest.model_validate({**body, "cache_control": mark}), engine, ids) is None
