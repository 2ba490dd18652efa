"""Hypothesis strategies for hostile request bodies, and the checks every answer to one must pass.

A body is the raw bytes a client might POST: a valid request of the route with one field
replaced, removed or added (at the top or inside its first message), any JSON value at all,
deep nesting, huge arrays, non-finite and huge numbers, every kind of unicode (lone surrogates
included, as JSON escapes), or bytes that are not JSON or not UTF-8.
"""
from __future__ import annotations

import base64
import json
import struct
import zlib
from typing import Any

import httpx
from hypothesis import strategies as st

from support.servers import parse_sse

MODEL = "smollm2-135m-instruct"
# Valid requests, short: max_tokens 2 keeps a body the fuzzer leaves valid cheap to answer.
BASES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/v1/completions": {"model": MODEL, "prompt": "Hello", "max_tokens": 2},
    "/v1/messages": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/responses": {"model": MODEL, "input": "Hi", "max_output_tokens": 2},
    "/tokenize": {"content": "Hello world"},
    "/detokenize": {"tokens": [19556, 905]},
    "/v1/score": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "candidates": ["Hello", 19556]},
    "/v1/decide": {"model": MODEL, "question": "Hi?", "options": ["yes", "no"]},
}
# Fields worth replacing beyond the base's own: the knobs each dialect reads.
KNOBS: dict[str, list[str]] = {
    "/v1/chat/completions": ["temperature", "top_p", "top_k", "n", "stop", "seed", "logit_bias", "logprobs",
                             "top_logprobs", "stream", "stream_options", "tools", "tool_choice", "response_format",
                             "max_completion_tokens", "presence_penalty", "frequency_penalty", "min_p", "user",
                             "ignore_eos", "min_tokens", "stop_token_ids", "priority", "cache_prompt",
                             "chat_template_kwargs", "parallel_tool_calls", "repetition_penalty", "typical_p",
                             "guided_json", "guided_regex", "guided_choice", "grammar"],
    "/v1/completions": ["temperature", "top_p", "n", "stop", "seed", "logit_bias", "logprobs", "echo", "suffix",
                        "stream", "stream_options", "best_of", "prompt_logprobs", "ignore_eos", "min_tokens",
                        "stop_token_ids", "priority", "cache_prompt", "response_format", "json_schema",
                        "guided_grammar", "structured_outputs"],
    "/v1/messages": ["system", "temperature", "top_p", "top_k", "stop_sequences", "stream", "tools", "tool_choice",
                     "metadata", "thinking", "service_tier", "output_config"],
    "/v1/messages/count_tokens": ["system", "tools", "tool_choice", "thinking"],
    "/v1/responses": ["instructions", "temperature", "top_p", "stream", "tools", "tool_choice", "text", "store",
                      "previous_response_id", "reasoning", "include", "truncation", "metadata",
                      "parallel_tool_calls", "max_tool_calls", "top_logprobs"],
    "/tokenize": ["add_special", "with_pieces", "messages", "model"],
    "/detokenize": ["model"],
    "/v1/score": ["prompt", "truncate", "candidates"],
    "/v1/decide": ["messages", "system", "instructions", "truncate", "options"],
}
# Where text goes in: each path gets hostile strings (a path through "messages" edits the first message).
TEXT_PATHS: dict[str, list[tuple[str, ...]]] = {
    "/v1/chat/completions": [("messages", "content"), ("messages", "name"), ("stop",), ("user",), ("model",),
                             ("chat_template_kwargs", "*"), ("logit_bias", "*"), ("*",)],
    "/v1/completions": [("prompt",), ("suffix",), ("stop",), ("model",), ("logit_bias", "*"), ("*",)],
    "/v1/messages": [("messages", "content"), ("system",), ("stop_sequences",), ("metadata", "user_id"), ("model",),
                     ("*",)],
    "/v1/messages/count_tokens": [("messages", "content"), ("system",), ("model",), ("*",)],
    "/v1/responses": [("input",), ("instructions",), ("previous_response_id",), ("metadata", "*"), ("model",), ("*",)],
    "/tokenize": [("content",), ("prompt",), ("model",), ("*",)],
    "/detokenize": [("model",), ("*",)],
    "/v1/score": [("messages", "content"), ("candidates",), ("prompt",), ("model",), ("*",)],
    "/v1/decide": [("question",), ("options",), ("system",), ("model",), ("*",)],
}
ROUTES = sorted(BASES)
STREAMABLE = {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"}

_numbers = st.one_of(
    st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
    st.sampled_from([0, -1, 1, 2 ** 31, 2 ** 63, -(2 ** 63) - 1, 10 ** 30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 5e-324]),
)
_text = st.one_of(
    st.text(st.characters(codec=None), max_size=40),  # any code point, lone surrogates included
    st.sampled_from(["", "\x00", "\ud800", "\udfff", "a\ud83dz", "\U0010ffff", "\ufeff", "<|im_end|>",
                     "<|endoftext|>", "\u202e", "🙂" * 50, "\n" * 100, "user", "assistant", "system", "tool"]),
)
_scalars = st.one_of(st.none(), st.booleans(), _numbers, _text)
json_values = st.recursive(
    _scalars,
    lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(_text, kids, max_size=4)),
    max_leaves=12,
)


def _png_claiming(width: int, height: int) -> str:
    """A data: URL of a PNG whose header claims width x height: a decompression bomb's first bytes."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(png).decode()


PNG_1PX = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
_image_urls = st.one_of(st.sampled_from([
    "data:image/png;base64," + PNG_1PX, "data:image/png;base64," + PNG_1PX[:30], "data:image/png;base64,@@",
    "data:text/plain;base64,aGk=", "data:image/png," + PNG_1PX, "http://127.0.0.1:1/x.png", "file:///etc/passwd",
    _png_claiming(100_000, 100_000), _png_claiming(1, 1), "data:image/gif;base64,R0lGODlh"]), _text, json_values)
_details = st.one_of(st.sampled_from(["auto", "low", "high"]), json_values)


def _image_part(route: str) -> st.SearchStrategy[Any]:
    """An image content part of the route's dialect, its fields valid, hostile or any JSON."""
    if route.startswith("/v1/messages"):
        source = st.fixed_dictionaries({"type": st.sampled_from(["base64", "url", "file"])}, optional={
            "media_type": st.one_of(st.sampled_from(["image/png", "image/gif", "text/plain"]), json_values),
            "data": st.one_of(st.just(PNG_1PX), _text, json_values), "url": _image_urls})
        return st.fixed_dictionaries({"type": st.just("image"), "source": st.one_of(source, json_values)})
    if route == "/v1/responses":
        return st.fixed_dictionaries({"type": st.just("input_image"), "image_url": _image_urls},
                                     optional={"detail": _details, "file_id": json_values})
    return st.one_of(
        st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.one_of(
            st.fixed_dictionaries({"url": _image_urls}, optional={"detail": _details}), _image_urls)}),
        st.fixed_dictionaries({"type": st.sampled_from(["video", "video_url"]),
                               "video": st.one_of(st.lists(_image_urls, max_size=3), json_values)}))


DEEP_MARK = "__deep__"
DEEP_JSON = '[{"a": ' * 2500 + "1" + "}]" * 2500  # 5000 levels: past Python's recursion limit


_special_values = st.sampled_from([
    "DEEP", "HUGE_LIST", "HUGE_INTS", "HUGE_STR", "HUGE_DICT"])


def _special(kind: str) -> Any:
    if kind == "DEEP":
        return DEEP_MARK
    if kind == "HUGE_LIST":
        return [{"role": "user", "content": "x"}] * 3000
    if kind == "HUGE_INTS":
        return list(range(20000))
    if kind == "HUGE_STR":
        return "word " * 20000
    return {f"k{i}": i for i in range(5000)}


def _encode(value: Any) -> bytes:
    """JSON as a client library writes it: NaN/Infinity as the bare words, non-ASCII (lone surrogates too) escaped."""
    return json.dumps(value, allow_nan=True, ensure_ascii=True).replace(f'"{DEEP_MARK}"', DEEP_JSON).encode()


@st.composite
def bodies(draw: st.DrawFn, route: str) -> bytes:
    """One hostile body for `route`."""
    base = json.loads(json.dumps(BASES[route]))
    if route in STREAMABLE and draw(st.booleans()):
        base["stream"] = True
    fields = sorted(set(base) | set(KNOBS[route]))
    kind = draw(st.sampled_from(["replace", "replace", "replace", "text", "text", "text", "drop", "extra", "nested",
                                 "special", "any", "raw", "image"]))
    if kind == "image" and ("messages" in base or route == "/v1/responses"):
        text = "input_text" if route == "/v1/responses" else "text"
        content = [{"type": text, "text": "see"}, draw(_image_part(route))]
        if route == "/v1/responses":
            base["input"] = [{"role": "user", "content": content}]
        else:
            base["messages"][0]["content"] = content
        return _encode(base)
    if kind == "text":
        path = draw(st.sampled_from(TEXT_PATHS[route]))
        value: Any = draw(st.one_of(_text, st.lists(_text, min_size=1, max_size=3)))
        where = base["messages"][0] if path[0] == "messages" else base
        keys = path[1:] if path[0] == "messages" else path
        for key in keys[:-1]:
            where = where.setdefault(key, {}) if isinstance(where.get(key), dict) or key not in where else {}
        where[draw(_text) if keys[-1] == "*" else keys[-1]] = value
    elif kind == "replace":
        base[draw(st.sampled_from(fields))] = draw(json_values)
    elif kind == "drop":
        base.pop(draw(st.sampled_from(sorted(base))), None)
    elif kind == "extra":
        base[draw(_text)] = draw(json_values)
    elif kind == "nested":
        target = next((k for k in ("messages", "input", "tokens", "prompt") if k in base), None)
        if target == "messages":
            msg = base["messages"][0]
            msg[draw(st.sampled_from(["role", "content", "name", "tool_calls", "tool_call_id", "type"]))] = draw(json_values)
        else:
            base[target or "content"] = draw(st.lists(json_values, max_size=4))
    elif kind == "special":
        field = draw(st.sampled_from(fields + ["<body>"]))
        value = _special(draw(_special_values))
        if field == "<body>":
            return _encode(value)
        base[field] = value
    elif kind == "any":
        return _encode(draw(json_values))
    else:
        return draw(st.one_of(
            st.binary(max_size=64),
            st.sampled_from([b"", b"{", b"{\"model\":", b"\xff\xfe{}", b"{\"a\": \"\xed\xa0\x80\"}", b"null",
                             b"[" * 100000, b"{\"a\":" * 50000, b"1" * 5000, b"{\"max_tokens\": 1" + b"0" * 5000 + b"}"]),
        ))
    return _encode(base)


def check_answer(route: str, body: bytes, r: httpx.Response) -> None:
    """The contract: a 2xx with a well-formed answer, or a 4xx (or 503) with the route's error envelope; never a 5xx."""
    assert r.status_code < 500 or r.status_code == 503, (
        f"{route} answered {r.status_code} to {body[:300]!r}: {r.text[:500]}")
    if r.status_code >= 400:
        err = r.json()
        if route.startswith("/v1/messages"):
            assert err["type"] == "error" and isinstance(err["error"]["message"], str), err
            assert isinstance(err["error"]["type"], str)
        else:
            assert isinstance(err["error"]["message"], str) and isinstance(err["error"]["type"], str), err
        return
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        check_stream(route, r.text)
        return
    answer = r.json()
    assert isinstance(answer, dict) and answer.get("error") is None, answer


STREAM_ENDS = {"/v1/messages": ("message_stop",), "/v1/responses": ("response.completed", "response.incomplete")}


def check_stream(route: str, raw: str) -> None:
    """A whole stream: well-formed frames, no error event, and the dialect's last frame."""
    frames = parse_sse(raw)
    assert frames, f"{route}: empty stream"
    for event, data in frames:
        assert event not in ("error", "response.failed"), f"{route}: stream ended in an error: {data[:300]}"
        if data != "[DONE]":
            msg = json.loads(data)
            assert not (isinstance(msg, dict) and msg.get("error")), f"{route}: error frame {data[:300]}"
    last_event, last_data = frames[-1]
    if route in STREAM_ENDS:
        assert last_event in STREAM_ENDS[route], f"{route}: stream ends with {last_event}: {last_data[:200]}"
    else:
        assert last_data == "[DONE]", f"{route}: stream ends with {last_data[:200]}"
