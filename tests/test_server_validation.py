"""Every validation rule answers 400 (or 404) with a JSON envelope naming the field, and logs one WARN line."""
from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest
from support.servers import MODEL, LiveServer, live_server  # noqa: F401

pytestmark = pytest.mark.real_model

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
ANY = object()  # "some param", when several fields are reported


def _with(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    body = {**base, **changes}
    return {k: v for k, v in body.items() if v is not _DROP}


_DROP = object()

# (path, body, expected param, expected code or None)
CASES: dict[str, tuple[str, dict[str, Any], str | None, str | None]] = {
    # wrong types
    "temperature_string": (CHAT_PATH, _with(CHAT, temperature="hot"), "temperature", None),
    "n_string": (CHAT_PATH, _with(CHAT, n="2"), "n", None),
    "n_bool": (CHAT_PATH, _with(CHAT, n=True), "n", None),
    "stream_string": (CHAT_PATH, _with(CHAT, stream="yes"), "stream", None),
    "max_tokens_float": (CHAT_PATH, _with(CHAT, max_tokens=1.5), "max_tokens", None),
    "messages_string": (CHAT_PATH, _with(CHAT, messages="hi"), "messages", None),
    "message_not_object": (CHAT_PATH, _with(CHAT, messages=["hi"]), "messages[0]", None),
    "content_number": (CHAT_PATH, _with(CHAT, messages=[{"role": "user", "content": 5}]), "messages[0].content", None),
    "stop_number": (CHAT_PATH, _with(CHAT, stop=3), "stop", None),
    "logit_bias_list": (CHAT_PATH, _with(CHAT, logit_bias=[1, 2]), "logit_bias", None),
    "model_number": (CHAT_PATH, _with(CHAT, model=7), "model", None),
    "stream_options_string": (CHAT_PATH, _with(CHAT, stream=True, stream_options="usage"), "stream_options", None),
    "prompt_number": (COMPLETIONS_PATH, _with(COMPLETION, prompt=5), "prompt", None),
    "prompt_mixed_ids": (COMPLETIONS_PATH, _with(COMPLETION, prompt=[1, "a"]), "prompt", None),
    "echo_string": (COMPLETIONS_PATH, _with(COMPLETION, echo="true"), "echo", None),
    # required fields and messages
    "model_missing": (CHAT_PATH, _with(CHAT, model=_DROP), "model", None),
    "messages_missing": (CHAT_PATH, _with(CHAT, messages=_DROP), "messages", None),
    "messages_empty": (CHAT_PATH, _with(CHAT, messages=[]), "messages", None),
    "unknown_role": (CHAT_PATH, _with(CHAT, messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role", None),
    "role_missing": (CHAT_PATH, _with(CHAT, messages=[{"content": "hi"}]), "messages[0].role", None),
    "user_content_missing": (CHAT_PATH, _with(CHAT, messages=[{"role": "user"}]), "messages[0].content", None),
    "image_part": (CHAT_PATH, _with(CHAT, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), "messages[0].content[0].image_url.url",
        "image_urls_off"),
    "video_url_part": (CHAT_PATH, _with(CHAT, messages=[{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "http://x"}}]}]), "messages[0].content[0].type", None),
    "prompt_missing": (COMPLETIONS_PATH, _with(COMPLETION, prompt=_DROP), "prompt", None),
    "prompt_batch": (COMPLETIONS_PATH, _with(COMPLETION, prompt=["a", "b"]), "prompt", None),
    "prompt_id_batch": (COMPLETIONS_PATH, _with(COMPLETION, prompt=[[1, 2], [3]]), "prompt", None),
    "prompt_empty_list": (COMPLETIONS_PATH, _with(COMPLETION, prompt=[]), "prompt", None),
    "prompt_id_outside_vocab": (COMPLETIONS_PATH, _with(COMPLETION, prompt=[1, 49152]), "prompt", None),
    "prompt_negative_id": (COMPLETIONS_PATH, _with(COMPLETION, prompt=[-1]), "prompt", None),
    # ranges (imp-API.md)
    "n_too_big": (CHAT_PATH, _with(CHAT, n=5), "n", None),
    "n_zero": (CHAT_PATH, _with(CHAT, n=0), "n", None),
    "best_of": (COMPLETIONS_PATH, _with(COMPLETION, best_of=2), "best_of", None),
    "temperature_negative": (CHAT_PATH, _with(CHAT, temperature=-0.1), "temperature", None),
    "top_p_zero": (CHAT_PATH, _with(CHAT, top_p=0), "top_p", None),
    "top_p_above_one": (CHAT_PATH, _with(CHAT, top_p=1.5), "top_p", None),
    "top_k_overflow": (CHAT_PATH, _with(CHAT, top_k=2**40), "top_k", None),
    "min_p_above_one": (CHAT_PATH, _with(CHAT, min_p=1.5), "min_p", None),
    "typical_p_zero": (CHAT_PATH, _with(CHAT, typical_p=0), "typical_p", None),
    "presence_penalty": (CHAT_PATH, _with(CHAT, presence_penalty=2.5), "presence_penalty", None),
    "frequency_penalty": (COMPLETIONS_PATH, _with(COMPLETION, frequency_penalty=-2.5), "frequency_penalty", None),
    "repetition_penalty_zero": (CHAT_PATH, _with(CHAT, repetition_penalty=0), "repetition_penalty", None),
    "max_tokens_zero": (CHAT_PATH, _with(CHAT, max_tokens=0), "max_tokens", None),
    "max_completion_tokens_zero": (CHAT_PATH, _with(CHAT, max_completion_tokens=0), "max_completion_tokens", None),
    "max_tokens_past_context": (COMPLETIONS_PATH, _with(COMPLETION, max_tokens=5000), "max_tokens",
                                "context_length_exceeded"),
    "prompt_past_context": (COMPLETIONS_PATH, _with(COMPLETION, prompt=[1] * 1024, max_tokens=_DROP), "prompt",
                            "context_length_exceeded"),
    "top_logprobs_without_logprobs": (CHAT_PATH, _with(CHAT, top_logprobs=2), "top_logprobs", None),
    "top_logprobs_too_many": (CHAT_PATH, _with(CHAT, logprobs=True, top_logprobs=21), "top_logprobs", None),
    "completion_logprobs_too_many": (COMPLETIONS_PATH, _with(COMPLETION, logprobs=21), "logprobs", None),
    "logit_bias_key_not_an_id": (CHAT_PATH, _with(CHAT, logit_bias={"hello": 1}), "logit_bias", None),
    "logit_bias_value": (CHAT_PATH, _with(CHAT, logit_bias={"5": 101}), "logit_bias", None),
    "logit_bias_outside_vocab": (CHAT_PATH, _with(CHAT, logit_bias={"49152": 1}), "logit_bias", None),
    "logit_bias_too_many": (CHAT_PATH, _with(CHAT, logit_bias={str(i): 1 for i in range(65)}), "logit_bias", None),
    "stop_empty_string": (CHAT_PATH, _with(CHAT, stop=[""]), "stop", None),
    "stop_too_many": (CHAT_PATH, _with(CHAT, stop=[f"s{i}" for i in range(17)]), "stop", None),
    "stop_token_id_outside_vocab": (CHAT_PATH, _with(CHAT, stop_token_ids=[10**6]), "stop_token_ids", None),
    "stream_options_without_stream": (CHAT_PATH, _with(CHAT, stream_options={"include_usage": True}),
                                      "stream_options", None),
    "seed_too_big": (CHAT_PATH, _with(CHAT, seed=2**70), "seed", None),
    # continue_final_message
    "continue_after_user": (CHAT_PATH, _with(CHAT, continue_final_message=True, add_generation_prompt=False),
                            "continue_final_message", None),
    "continue_with_generation_prompt": (CHAT_PATH, _with(CHAT, messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}],
        continue_final_message=True, add_generation_prompt=True), "continue_final_message", None),
    "continue_empty_assistant": (CHAT_PATH, _with(CHAT, messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}], continue_final_message=True),
        "continue_final_message", None),
    # not supported (yet)
    "fim_without_fim_tokens": (COMPLETIONS_PATH, _with(COMPLETION, suffix="return x"), "suffix", "fim_not_supported"),
    "prompt_logprobs_streamed": (COMPLETIONS_PATH, _with(COMPLETION, prompt_logprobs=1, stream=True),
                                 "prompt_logprobs", "invalid_request_error"),
    "prompt_logprobs_range": (COMPLETIONS_PATH, _with(COMPLETION, prompt_logprobs=21), "prompt_logprobs",
                              "invalid_request_error"),
    "echo_with_logprobs_streamed": (COMPLETIONS_PATH, _with(COMPLETION, echo=True, logprobs=1, stream=True), "echo",
                                    "invalid_request_error"),
    "tool_choice_without_tools": (CHAT_PATH, _with(CHAT, tool_choice="required"), "tool_choice",
                                  "invalid_request_error"),
    "response_format_type": (CHAT_PATH, _with(CHAT, response_format={"type": "xml"}), "response_format.type", None),
    # tokenize / detokenize
    "tokenize_nothing": ("/tokenize", {}, "content", None),
    "tokenize_two_inputs": ("/tokenize", {"content": "a", "prompt": "b"}, "prompt", None),
    "tokenize_content_number": ("/tokenize", {"content": 5}, "content", None),
    "detokenize_outside_vocab": ("/detokenize", {"tokens": [49152]}, "tokens", None),
    "detokenize_missing": ("/detokenize", {}, "tokens", None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_invalid_request_is_a_400_naming_the_field(live_server: LiveServer, name: str) -> None:
    path, body, param, code = CASES[name]
    r = httpx.post(live_server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'"text"', b"\xff\xfe", b'{"model": "m",}'])
@pytest.mark.parametrize("path", [CHAT_PATH, COMPLETIONS_PATH, "/tokenize"])
def test_malformed_json_is_a_400(live_server: LiveServer, path: str, raw: bytes) -> None:
    r = httpx.post(live_server.url + path, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_json"


def test_unknown_fields_are_ignored(live_server: LiveServer) -> None:
    r = httpx.post(live_server.url + CHAT_PATH, json={**CHAT, "some_future_field": {"x": 1}}, timeout=60)
    assert r.status_code == 200


def test_unknown_model_is_a_404(live_server: LiveServer) -> None:
    r = httpx.post(live_server.url + COMPLETIONS_PATH, json={**COMPLETION, "model": "llama-9000"})
    assert r.status_code == 404
    assert r.json()["error"] | {"message": None} == {"message": None, "type": "not_found_error", "param": "model",
                                                    "code": "model_not_found"}


def test_unmatched_routes_answer_json(live_server: LiveServer) -> None:
    r = httpx.get(live_server.url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.post(live_server.url + "/v1/messages/nothing", json={})
    assert r.status_code == 404
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(live_server.url + CHAT_PATH)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed" and "POST" in r.headers["allow"]


def test_request_id_is_echoed_sanitised(live_server: LiveServer) -> None:
    r = httpx.post(live_server.url + CHAT_PATH, json={**CHAT, "n": 9}, headers={"X-Request-Id": "trace-1 ok"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "trace-1 ok"
    r = httpx.get(live_server.url + "/nowhere", headers={"X-Request-Id": "z" * 300})
    assert r.headers["x-request-id"] == "z" * 128
    r = httpx.post(live_server.url + CHAT_PATH, json=CHAT, headers={"X-Request-Id": "client-42"}, timeout=60)
    assert r.headers["x-request-id"] == "client-42" and r.json()["id"].startswith("chatcmpl-")
    r = httpx.post(live_server.url + CHAT_PATH, json=CHAT, timeout=60)
    assert r.headers["x-request-id"] == r.json()["id"]


def test_each_4xx_logs_one_warn_line(live_server: LiveServer) -> None:
    marker = f"no-such-model-{uuid.uuid4().hex}"
    r = httpx.post(live_server.url + CHAT_PATH, json={**CHAT, "model": marker})
    assert r.status_code == 404
    log = live_server.log_text()
    lines = [line for line in log.splitlines() if marker in line]
    assert len(lines) == 1, lines
    assert "WARNING" in lines[0] and f"HTTP 404 POST {CHAT_PATH}: " in lines[0]


# Found by the fuzzer (tests/test_server_fuzz.py): each answered 500 before.
DEEP = b'{"model": "m", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
HOSTILE: dict[str, tuple[str, bytes, str | None, str]] = {
    "nesting_past_the_parser": (CHAT_PATH, DEEP, None, "invalid_json"),
    "nesting_past_the_limit": (COMPLETIONS_PATH, b'{"prompt": "a", "x": ' + b"[" * 65 + b"]" * 65 + b"}", None,
                               "invalid_json"),
    "surrogate_in_chat_content": (CHAT_PATH, b'{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
                                  % MODEL.encode(), "messages[0].content", "invalid_unicode"),
    "surrogate_in_prompt": (COMPLETIONS_PATH, b'{"model": "%s", "prompt": "\\udfff"}' % MODEL.encode(), "prompt",
                            "invalid_unicode"),
    "surrogate_in_messages_system": ("/v1/messages", b'{"model": "%s", "max_tokens": 2, "system": "\\ud800", '
                                     b'"messages": [{"role": "user", "content": "hi"}]}' % MODEL.encode(), "system",
                                     "invalid_unicode"),
    "surrogate_in_a_key": ("/v1/responses", b'{"model": "%s", "input": "hi", "metadata": {"\\ud800": "x"}}'
                           % MODEL.encode(), "metadata.?", "invalid_unicode"),
    "surrogate_in_tokenize": ("/tokenize", b'{"content": "\\ud83d"}', "content", "invalid_unicode"),
    "template_kwargs_messages": (CHAT_PATH, b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], '
                                 b'"chat_template_kwargs": {"messages": 1}}' % MODEL.encode(),
                                 "chat_template_kwargs.messages", "invalid_request_error"),
    "template_kwargs_tools": (CHAT_PATH, b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], '
                              b'"chat_template_kwargs": {"tools": 5, "add_generation_prompt": 1}}' % MODEL.encode(),
                              "chat_template_kwargs.add_generation_prompt", "invalid_request_error"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_json_is_a_400_naming_the_field(live_server: LiveServer, name: str) -> None:
    path, raw, param, code = HOSTILE[name]
    r = httpx.post(live_server.url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and (param is None or param in error["message"]), error
    if not path.startswith("/v1/messages"):  # the Anthropic envelope has no param or code
        assert error["param"] == param and error["code"] == code, error


def test_a_paired_surrogate_escape_is_text(live_server: LiveServer) -> None:
    r = httpx.post(live_server.url + "/tokenize", content=b'{"content": "\\ud83d\\ude42"}',
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["tokens"] == httpx.post(
        live_server.url + "/tokenize", json={"content": "🙂"}).json()["tokens"]
