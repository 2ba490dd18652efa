"""OpenAI Responses end to end (the official `openai` package on the real engine), raw 400s, the store's
limits (unit tests and a FakeEngine server with a tiny TTL and caps), and faults over FakeEngine."""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from support.servers import (FAULT_MARKER, MODEL, FakeEngine, LiveServer, app_in_thread, fake_server,  # noqa: F401
                             fake_tokenizer, live_server, openai_client, parse_sse, wait_for)

from imp_jax.server.app import create_app
from imp_jax.server.context import ServerConfig
from imp_jax.server.responses_store import ResponsesStore, StoreLimits, entry_size

real = pytest.mark.real_model
INSTRUCTIONS = "You are a terse assistant."
QUESTION = "Name three colours."
GREEDY: dict[str, Any] = dict(model=MODEL, temperature=0, max_output_tokens=10, instructions=INSTRUCTIONS)
PATH = "/v1/responses"
STREAM_KINDS = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added"]
DONE_KINDS = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def _chat(live: LiveServer, messages: list[dict[str, str]], max_tokens: int = 10) -> dict[str, Any]:
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": max_tokens}
    return httpx.post(live.url + "/v1/chat/completions", json=body, timeout=120).json()


# --------------------------------------------------------------------------- the real engine, through the SDK
@real
def test_response_object(openai_client: openai.OpenAI) -> None:
    raw = openai_client.responses.with_raw_response.create(**GREEDY, input=QUESTION)
    r = raw.parse()
    assert r.id.startswith("resp_") and raw.headers["x-request-id"] == r.id
    assert r.object == "response" and r.model == MODEL and r.status in ("completed", "incomplete")
    assert r.instructions == INSTRUCTIONS and r.max_output_tokens == 10 and r.previous_response_id is None
    assert r.store is True and r.error is None and r.tools == []
    (item,) = r.output
    assert item.type == "message" and item.id.startswith("msg_") and item.role == "assistant"
    assert item.status == r.status
    (part,) = item.content
    assert part.type == "output_text" and part.annotations == [] and part.text == r.output_text != ""
    u = r.usage
    assert 0 < u.output_tokens <= 10 and u.output_tokens_details.reasoning_tokens == 0
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.input_tokens_details.cached_tokens >= 0
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"


@real
def test_prompt_is_the_chat_prompt(live_server: LiveServer, openai_client: openai.OpenAI) -> None:
    """instructions = a system message, a string input = one user message: the chat answer, token for token."""
    chat = _chat(live_server, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}])
    r = openai_client.responses.create(**GREEDY, input=QUESTION)
    assert r.output_text == chat["choices"][0]["message"]["content"]
    assert r.usage.input_tokens == chat["usage"]["prompt_tokens"]
    items = openai_client.responses.create(**{**GREEDY, "instructions": None}, input=[
        {"role": "developer", "content": INSTRUCTIONS},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    assert items.output_text == r.output_text and items.usage.input_tokens == r.usage.input_tokens


@real
def test_stream_equals_the_whole_response(openai_client: openai.OpenAI) -> None:
    whole = openai_client.responses.create(**GREEDY, input=QUESTION)
    events = list(openai_client.responses.create(**GREEDY, input=QUESTION, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == STREAM_KINDS and kinds[-4:-1] == DONE_KINDS
    assert kinds[-1] == f"response.{whole.status}"
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == events[-4].text == final.output_text == whole.output_text
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if hasattr(e, "item_id")) and final.output[0].id == item_id
    assert final.usage.output_tokens == whole.usage.output_tokens and final.id != whole.id


WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@real
@pytest.mark.parametrize("extra", [
    {},                                                                      # completed
    {"max_output_tokens": 3},                                                # incomplete
    {"tools": [WEATHER_TOOL], "tool_choice": "required", "max_output_tokens": 40},   # a function call
    {"include": ["message.output_text.logprobs"], "top_logprobs": 2, "metadata": {"k": "v"}},
], ids=["completed", "incomplete", "call", "logprobs"])
def test_every_event_and_the_whole_response_pass_the_sdks_strict_validation(live_server: LiveServer,
                                                                              extra: dict[str, Any]) -> None:
    """The openai client first validates an event strictly against its union of event models; only when that
    fails does it pick the model by `type` and build it unchecked, and that path races when threads parse
    their first events at once (pydantic builds the models' schemas lazily): a `response.completed` then came
    back with `response` a plain dict. So every field the SDK requires must be there."""
    from openai._models import validate_type
    from openai.types.responses import Response, ResponseStreamEvent
    body = {**GREEDY, "input": QUESTION, **extra}
    whole = httpx.post(live_server.url + PATH, json=body, timeout=120)
    assert validate_type(type_=Response, value=whole.json()).id == whole.json()["id"]
    with httpx.stream("POST", live_server.url + PATH, json={**body, "stream": True}, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events and events[-1]["type"] in ("response.completed", "response.incomplete")
    for ev in events:
        assert type(validate_type(type_=ResponseStreamEvent, value=ev)).__name__ != "dict", ev["type"]


@real
def test_stream_helper_and_the_streamed_response_is_stored(openai_client: openai.OpenAI) -> None:
    full = openai_client.responses.create(**{**GREEDY, "max_output_tokens": 16}, input=QUESTION).output_text
    words = full.split()
    assert len(words) >= 2, full
    # a stop string makes it `completed`: the SDK helper wants response.completed (not .incomplete)
    with openai_client.responses.stream(**{**GREEDY, "max_output_tokens": 16}, input=QUESTION,
                                        extra_body={"stop": [words[1]]}) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and text == final.output_text != "" and full.startswith(text)
    got = openai_client.responses.retrieve(final.id)
    assert (got.id, got.status, got.output_text, got.usage) == (final.id, final.status, final.output_text, final.usage)


@real
def test_max_output_tokens_makes_it_incomplete(openai_client: openai.OpenAI) -> None:
    r = openai_client.responses.create(**{**GREEDY, "max_output_tokens": 5}, input=QUESTION,
                                       extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output[0].status == "incomplete"


@real
def test_previous_response_id_continues_the_conversation(live_server: LiveServer,
                                                         openai_client: openai.OpenAI) -> None:
    first = openai_client.responses.create(**GREEDY, input="My name is Ada. Reply with one word.")
    second = openai_client.responses.create(**GREEDY, input="What is my name?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    # the stored conversation is the previous input plus its output; instructions are not carried over
    chat = _chat(live_server, [{"role": "system", "content": INSTRUCTIONS},
                               {"role": "user", "content": "My name is Ada. Reply with one word."},
                               {"role": "assistant", "content": first.output_text},
                               {"role": "user", "content": "What is my name?"}])
    assert second.output_text == chat["choices"][0]["message"]["content"]
    assert second.usage.input_tokens == chat["usage"]["prompt_tokens"]
    third = openai_client.responses.create(**{**GREEDY, "instructions": None}, input="And again?",
                                           previous_response_id=second.id, stream=True)
    final = [e for e in third][-1].response
    assert final.previous_response_id == second.id and final.instructions is None
    assert final.usage.input_tokens > second.usage.input_tokens


@real
def test_retrieve_and_delete(live_server: LiveServer, openai_client: openai.OpenAI) -> None:
    r = openai_client.responses.create(**GREEDY, input=QUESTION, metadata={"run": "42"})
    got = openai_client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.metadata == {"run": "42"}
    raw = httpx.delete(live_server.url + f"{PATH}/{r.id}")
    assert raw.status_code == 200 and raw.json() == {"id": r.id, "object": "response", "deleted": True}
    for call in (lambda: openai_client.responses.retrieve(r.id), lambda: openai_client.responses.delete(r.id),
                 lambda: openai_client.responses.create(**GREEDY, input="hi", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.code == "response_not_found"
    other = openai_client.responses.create(**GREEDY, input=QUESTION)
    assert openai_client.responses.delete(other.id) is None  # the SDK's delete returns nothing on success


@real
def test_store_false_keeps_nothing(openai_client: openai.OpenAI) -> None:
    r = openai_client.responses.create(**GREEDY, input=QUESTION, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as info:
        openai_client.responses.create(**GREEDY, input="more", previous_response_id=r.id)
    assert info.value.body["param"] == "previous_response_id" and info.value.body["code"] == "response_not_found"


@real
def test_unknown_ids_are_404_response_not_found(live_server: LiveServer) -> None:
    for method in ("GET", "DELETE"):
        r = httpx.request(method, live_server.url + f"{PATH}/resp_nope")
        assert r.status_code == 404
        assert r.json()["error"] | {"message": None} == {"message": None, "type": "not_found_error",
                                                        "param": "response_id", "code": "response_not_found"}
    r = httpx.post(live_server.url + PATH, json={"model": MODEL, "input": "hi", "previous_response_id": "resp_nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"


@real
def test_continue_final_message(live_server: LiveServer, openai_client: openai.OpenAI) -> None:
    prefix = "Red, green and"
    r = openai_client.responses.create(**GREEDY, input=[
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": prefix}],
        extra_body={"continue_final_message": True})
    head = httpx.post(live_server.url + "/tokenize", json={"messages": [
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]}).json()["tokens"]
    tail = httpx.post(live_server.url + "/tokenize", json={"content": prefix}).json()["tokens"]
    assert r.usage.input_tokens == len(head) + len(tail)
    expected = httpx.post(live_server.url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": head + tail, "temperature": 0, "max_tokens": 10}).json()["choices"][0]["text"]
    assert r.output_text == expected


@real
def test_extension_fields_are_accepted(openai_client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, input=QUESTION, max_output_tokens=8, temperature=1.0, top_p=0.9, user="tester",
              extra_body={"top_k": 40, "min_p": 0.05, "typical_p": 0.95, "presence_penalty": 0.5,
                          "frequency_penalty": 0.3, "repetition_penalty": 1.1, "seed": 7, "priority": 2,
                          "cache_prompt": True, "stop": ["\n\n"]})
    a, b = openai_client.responses.create(**kw), openai_client.responses.create(**kw)
    assert a.output_text == b.output_text and a.user == "tester"


# --------------------------------------------------------------------------- every validation rule, raw
BODY: dict[str, Any] = {"model": MODEL, "input": "hi", "max_output_tokens": 4}
_DROP = object()


def _with(**changes: Any) -> dict[str, Any]:
    return {k: v for k, v in {**BODY, **changes}.items() if v is not _DROP}


CASES: dict[str, tuple[dict[str, Any], str, str | None]] = {
    "model_missing": (_with(model=_DROP), "model", None),
    "input_missing": (_with(input=_DROP), "input", None),
    "input_number": (_with(input=5), "input", None),
    "input_empty_list": (_with(input=[]), "input", None),
    "input_empty_string": (_with(input=""), "input", None),
    "item_not_object": (_with(input=["hi"]), "input[0]", None),
    "item_bad_role": (_with(input=[{"role": "tool", "content": "x"}]), "input[0].role", None),
    "item_role_missing": (_with(input=[{"content": "x"}]), "input[0].role", None),
    "item_content_number": (_with(input=[{"role": "user", "content": 5}]), "input[0].content", None),
    "item_reference": (_with(input=[{"type": "item_reference", "id": "rs_1"}]), "input[0].type", None),
    "item_function_call_no_name": (_with(input=[{"type": "function_call", "call_id": "c", "arguments": "{}"}]),
                                   "input[0].name", None),
    "part_image": (_with(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]),
                   "input[0].content[0].image_url", "image_urls_off"),
    "part_file": (_with(input=[{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]),
                  "input[0].content[0].type", None),
    "part_text_missing": (_with(input=[{"role": "user", "content": [{"type": "input_text"}]}]),
                          "input[0].content[0].text", None),
    "instructions_number": (_with(instructions=5), "instructions", None),
    "max_output_tokens_zero": (_with(max_output_tokens=0), "max_output_tokens", None),
    "max_output_tokens_string": (_with(max_output_tokens="4"), "max_output_tokens", None),
    "max_tokens_is_not_a_responses_field": (_with(max_tokens=4), "max_tokens", None),
    "n_two": (_with(n=2), "n", None),
    "temperature_negative": (_with(temperature=-1), "temperature", None),
    "temperature_string": (_with(temperature="hot"), "temperature", None),
    "top_p_zero": (_with(top_p=0), "top_p", None),
    "top_k_overflow": (_with(top_k=2**40), "top_k", None),
    "min_p_above_one": (_with(min_p=2), "min_p", None),
    "typical_p_zero": (_with(typical_p=0), "typical_p", None),
    "presence_penalty": (_with(presence_penalty=3), "presence_penalty", None),
    "repetition_penalty_zero": (_with(repetition_penalty=0), "repetition_penalty", None),
    "logit_bias_outside_vocab": (_with(logit_bias={"49152": 1}), "logit_bias", None),
    "stream_string": (_with(stream="yes"), "stream", None),
    "store_string": (_with(store="yes"), "store", None),
    "previous_response_id_number": (_with(previous_response_id=5), "previous_response_id", None),
    "metadata_value_number": (_with(metadata={"a": 1}), "metadata.a", None),
    "metadata_too_many": (_with(metadata={f"k{i}": "v" for i in range(17)}), "metadata", None),
    "metadata_value_too_long": (_with(metadata={"a": "v" * 513}), "metadata.a", None),
    "truncation_bad": (_with(truncation="sometimes"), "truncation", None),
    "tool_type_unknown": (_with(tools=[{"type": "computer_use"}, {"type": "retrieval"}]), "tools[1].type", None),
    "json_schema_format_unenforceable": (_with(text={"format": {"type": "json_schema", "name": "x",
                                                                "schema": {"not": {}}}}), "text.format.schema", None),
    "background": (_with(background=True), "background", "not_supported"),
    "continue_after_user": (_with(continue_final_message=True), "continue_final_message", None),
    "prompt_past_context": (_with(input="go " * 1100), "input", "context_length_exceeded"),
}


@real
@pytest.mark.parametrize("name", list(CASES))
def test_invalid_request_is_a_400_naming_the_field(live_server: LiveServer, name: str) -> None:
    body, param, code = CASES[name]
    r = httpx.post(live_server.url + PATH, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


@real
def test_unknown_model_is_a_404(live_server: LiveServer) -> None:
    r = httpx.post(live_server.url + PATH, json={**BODY, "model": "gpt-5"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# --------------------------------------------------------------------------- the store on its own
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _resp(rid: str, text: str = "x") -> tuple[dict[str, Any], list[dict[str, str]]]:
    return {"id": rid, "object": "response"}, [{"role": "user", "content": text}]


def test_store_put_get_delete() -> None:
    store = ResponsesStore(StoreLimits(ttl_s=10, max_entries=4, max_bytes=10_000), Clock())
    assert store.put("a", *_resp("a")) and len(store) == 1 and "a" in store
    entry = store.get("a")
    assert entry.response["id"] == "a" and entry.conversation == [{"role": "user", "content": "x"}]
    assert store.bytes_used == entry.size == entry_size(*_resp("a"))
    assert store.delete("a") and not store.delete("a") and store.get("a") is None
    assert len(store) == 0 and store.bytes_used == 0


def test_store_entries_expire_after_the_ttl() -> None:
    clock = Clock()
    store = ResponsesStore(StoreLimits(ttl_s=10, max_entries=4, max_bytes=10_000), clock)
    store.put("a", *_resp("a"))
    clock.now += 5
    store.put("b", *_resp("b"))
    clock.now += 5
    assert store.get("a") is None and store.get("b") is not None
    clock.now += 5
    assert "b" not in store and store.bytes_used == 0
    assert store.stats() == {"entries": 0, "bytes": 0, "evictions": 0, "expirations": 2}


def test_store_entry_cap_evicts_the_least_recently_used() -> None:
    store = ResponsesStore(StoreLimits(ttl_s=10, max_entries=3, max_bytes=10_000), Clock())
    for rid in "abc":
        store.put(rid, *_resp(rid))
    store.get("a")  # a is now the most recently used; b the least
    store.put("d", *_resp("d"))
    assert [rid for rid in "abcd" if rid in store] == ["a", "c", "d"] and store.evictions == 1


def test_store_byte_cap_evicts_oldest_and_refuses_the_oversized() -> None:
    size = entry_size(*_resp("a", "x" * 100))
    store = ResponsesStore(StoreLimits(ttl_s=10, max_entries=100, max_bytes=int(size * 2.5)), Clock())
    for rid in "abc":
        assert store.put(rid, *_resp(rid, "x" * 100))
    assert [rid for rid in "abc" if rid in store] == ["b", "c"] and store.bytes_used == 2 * size
    assert not store.put("big", *_resp("big", "x" * 1000))
    assert "big" not in store and len(store) == 2
    store.put("b", *_resp("b", "y"))  # replacing an entry recharges its bytes
    assert store.bytes_used == size + entry_size(*_resp("b", "y"))


@pytest.mark.parametrize("cap", ["entries", "bytes"])
def test_one_keys_flood_evicts_its_own_responses_not_another_keys(cap) -> None:
    """Key A stores 2 of 6 entries, key B floods: B's least recently used go, A's stay; past a fair share
    A's own LRU goes first too."""
    size = entry_size(*_resp("a00"))   # every id of 3 characters: one size
    limits = StoreLimits(ttl_s=10, max_entries=6, max_bytes=10**6) if cap == "entries" else \
        StoreLimits(ttl_s=10, max_entries=100, max_bytes=6 * size)
    store = ResponsesStore(limits, Clock())
    for i in range(2):
        assert store.put(f"a{i:02d}", *_resp(f"a{i:02d}"), owner="A")
    for i in range(50):
        assert store.put(f"b{i:02d}", *_resp(f"b{i:02d}"), owner="B")
    assert store.get("a00", "A") and store.get("a01", "A") and store.evictions == 46
    assert [i for i in range(50) if store.get(f"b{i:02d}", "B")] == [46, 47, 48, 49]
    for i in range(2, 6):   # A grows past B: now A's oldest go
        store.put(f"a{i:02d}", *_resp(f"a{i:02d}"), owner="A")
    assert sum(store.get(f"a{i:02d}", "A") is not None for i in range(6)) == 3 and store.get("b49", "B")


def test_store_with_zero_limits_keeps_nothing() -> None:
    for limits in (StoreLimits(ttl_s=0), StoreLimits(max_entries=0), StoreLimits(max_bytes=0)):
        store = ResponsesStore(limits, Clock())
        assert not store.put("a", *_resp("a")) and store.get("a") is None


def test_store_limits_come_from_the_command_line() -> None:
    from imp_jax.runtime.config import EngineConfig
    from imp_jax.server.cli import parse_config

    config = parse_config(["--responses-store-ttl-s", "60", "--responses-store-max-entries", "5",
                           "--responses-store-max-bytes", "1000"], EngineConfig)
    assert (config.responses_store_ttl_s, config.responses_store_max_entries,
            config.responses_store_max_bytes) == (60.0, 5, 1000)
    default = ServerConfig()
    assert default.responses_store_ttl_s > 0 and default.responses_store_max_bytes > 0


# --------------------------------------------------------------------------- FakeEngine: a server with tiny limits
FAKE = {"model": "fake-model", "input": "hi", "max_output_tokens": 4}


@pytest.fixture(scope="module")
def tiny_store_server() -> Iterator[str]:
    """The app over FakeEngine with a 0.5 s TTL and room for two stored responses."""
    engine = FakeEngine(fake_tokenizer())
    engine.start()
    config = ServerConfig(responses_store_ttl_s=0.5, responses_store_max_entries=2)
    with app_in_thread(create_app(engine, config)) as url:
        wait_for(url + "/ready", 200, timeout=30)
        yield url


def _create(url: str, **kw: Any) -> httpx.Response:
    return httpx.post(url + PATH, json={**FAKE, **kw}, timeout=30)


def test_server_store_expires_after_its_ttl(tiny_store_server: str) -> None:
    url = tiny_store_server
    rid = _create(url).json()["id"]
    assert httpx.get(f"{url}{PATH}/{rid}").status_code == 200
    assert _create(url, previous_response_id=rid).status_code == 200
    time.sleep(0.6)
    assert httpx.get(f"{url}{PATH}/{rid}").json()["error"]["code"] == "response_not_found"
    assert _create(url, previous_response_id=rid).status_code == 404


def test_server_store_evicts_past_its_entry_cap(tiny_store_server: str) -> None:
    url = tiny_store_server
    ids = [_create(url).json()["id"] for _ in range(3)]
    assert [httpx.get(f"{url}{PATH}/{rid}").status_code for rid in ids] == [404, 200, 200]


def test_fault_mid_stream_ends_with_an_error_event(fake_server: tuple[str, FakeEngine]) -> None:
    url, _ = fake_server
    r = httpx.post(url + PATH, json={**FAKE, "input": f"please {FAULT_MARKER}", "stream": True}, timeout=30)
    frames = parse_sse(r.text)
    assert [e for e, _ in frames[:4]] == STREAM_KINDS
    event, data = frames[-1]
    err = json.loads(data)
    assert event == "error" and err["type"] == "error" and err["code"] == "engine_faulted"
    assert "injected" in err["message"] and err["sequence_number"] == len(frames) - 1
    assert not any(e.startswith("response.completed") for e, _ in frames)
    deltas = "".join(json.loads(d)["delta"] for e, d in frames if e == "response.output_text.delta")
    assert deltas == "The quick"
    rid = json.loads(frames[0][1])["response"]["id"]
    assert httpx.get(f"{url}{PATH}/{rid}").status_code == 404  # a failed response is not stored


def test_fault_without_streaming_is_a_500(fake_server: tuple[str, FakeEngine]) -> None:
    url, _ = fake_server
    r = httpx.post(url + PATH, json={**FAKE, "input": FAULT_MARKER}, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_faulted"


# ------------------------------------------------------------------ truncation, include
def _long_input(turns: int, words: int = 120) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = [{"role": "developer", "content": "Answer in one word."}]
    for i in range(turns):
        items += [{"role": "user", "content": f"Story {i}: " + "the cat sat on the mat " * (words // 6)},
                  {"role": "assistant", "content": "Noted."}]
    return items + [{"role": "user", "content": "Say hi."}]


def test_truncation_auto_drops_the_oldest_turns(live_server: LiveServer) -> None:
    body = {"model": MODEL, "input": _long_input(12), "max_output_tokens": 2, "temperature": 0}
    r = httpx.post(live_server.url + PATH, json=body, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = httpx.post(live_server.url + PATH, json={**body, "truncation": "auto"}, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["truncation"] == "auto" and 800 < out["usage"]["input_tokens"] < 1024
    too_long = {**body, "truncation": "auto", "input": [{"role": "user", "content": "the cat sat " * 400}]}
    r = httpx.post(live_server.url + PATH, json=too_long, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


def test_fit_context_keeps_system_messages_and_the_last_user_turn() -> None:
    from imp_jax.server.prompts import fit_context

    turns = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
             {"role": "assistant", "content": "b", "tool_calls": [{"id": "c"}]}, {"role": "tool", "content": "r"},
             {"role": "user", "content": "q"}]
    seen: list[list[str]] = []

    def tokenize(t: list[dict[str, Any]]) -> list[int]:
        seen.append([m["content"] for m in t])
        return [0] * (10 * len(t))

    fit_context(turns, tokenize, 25)
    assert seen == [["s", "a", "b", "r", "q"], ["s", "b", "r", "q"], ["s", "q"]]


def test_include_output_text_logprobs(live_server: LiveServer) -> None:
    body = {"model": MODEL, "input": "Say hi.", "max_output_tokens": 4, "temperature": 0,
            "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    r = httpx.post(live_server.url + PATH, json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    lps = out["output"][0]["content"][0]["logprobs"]
    assert len(lps) == out["usage"]["output_tokens"] and all(len(e["top_logprobs"]) == 2 for e in lps)
    assert "".join(e["token"] for e in lps).startswith(out["output"][0]["content"][0]["text"])
    with httpx.stream("POST", live_server.url + PATH, json={**body, "stream": True}, timeout=120) as s:
        events = [json.loads(d) for _, d in parse_sse(s.read().decode())]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert sum(len(e["logprobs"]) for e in deltas) == len(done["logprobs"]) == len(lps)


@pytest.mark.parametrize("extra, param", [
    ({"include": ["message.output_text.logprobs", "file_search_call.results"]}, "include[1]"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"truncation": "middle"}, "truncation"),
])
def test_include_and_foreign_fields_are_400s_naming_them(live_server: LiveServer, extra: dict, param: str) -> None:
    r = httpx.post(live_server.url + PATH, json={"model": MODEL, "input": "hi", **extra}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
