"""Anthropic Messages: `POST /v1/messages` (whole or streamed per token) and `POST /v1/messages/count_tokens`.

Native wire format, no shim through Chat: text blocks in, one text block out, Anthropic's
stop reasons and usage, its SSE event sequence with pings, and its error envelope (errors.py).
"""
from __future__ import annotations

import logging
import uuid
from typing import Any, Literal

from pydantic import field_validator
from quart import Blueprint, Response, current_app, jsonify, request

from imp_jax.errors import ImpError, InvalidRequestError
from imp_jax.runtime.request import EngineEvent, GenerationRequest, SamplingParams, Usage, check_context
from imp_jax.server import lifecycle, structured
from imp_jax.server.context import engine_request, set_response_id
from imp_jax.server.errors import anthropic_error_body, is_anthropic_path, not_supported
from imp_jax.server.generation import collect
from imp_jax.server.openai_common import MAX_STOP, OpenAISampling
from imp_jax.server.streaming import drive, sse, sse_response
from imp_jax.server.validation import WireModel

bp = Blueprint("anthropic_messages", __name__)
log = logging.getLogger("imp_jax.server")

PING_INTERVAL_S = 10.0  # a ping after this much silence keeps proxies from closing a slow stream
BLOCK_JOIN = "\n"       # text blocks of one turn, and consecutive same-role turns, join with this (as vLLM)
ECHOED_HEADERS = ("anthropic-version", "anthropic-beta")
_BETAS_SEEN = "imp_jax.anthropic_betas"  # app.extensions key: the beta values already logged


def new_message_id() -> str:
    """A message id in Anthropic's spelling; it is also the engine request id."""
    return f"msg_{uuid.uuid4().hex}"


class TextBlock(WireModel):
    """A content block; only `text` blocks are served (images, documents, tools: a 400 naming the block)."""

    type: str
    text: str
    cache_control: dict[str, Any] | None = None

    @field_validator("type")
    @classmethod
    def _text_only(cls, v: str) -> str:
        if v != "text":
            raise ValueError(f"content block type {v!r} is not supported; only 'text' blocks are")
        return v


def _as_blocks(v: Any) -> Any:
    """A plain string is one text block; anything but a string or a list is refused here."""
    if isinstance(v, str):
        return [{"type": "text", "text": v}]
    if v is not None and not isinstance(v, list):
        raise ValueError("must be a string or a list of content blocks")
    return v


class Message(WireModel):
    role: Literal["user", "assistant"]
    content: list[TextBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _string_or_blocks(cls, v: Any) -> Any:
        return _as_blocks(v)

    @property
    def text(self) -> str:
        return BLOCK_JOIN.join(b.text for b in self.content if b.text)


class Metadata(WireModel):
    user_id: str | None = None


class Conversation(WireModel):
    """What /v1/messages and count_tokens share: the model, the system prompt and the turns."""

    model: str
    messages: list[Message]
    system: list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    thinking: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None  # top level: a breakpoint on the last cacheable block
    output_config: dict[str, Any] | None = None  # `format`: JSON outputs (structured.py); `effort` is ignored

    @field_validator("system", mode="before")
    @classmethod
    def _system_string_or_blocks(cls, v: Any) -> Any:
        return _as_blocks(v)

    def check_conversation(self) -> None:
        """Anthropic's rules: at least one turn, none empty but a final assistant prefill; text only."""
        if not self.messages:
            raise InvalidRequestError("'messages' must hold at least one message", param="messages")
        last = len(self.messages) - 1
        for i, m in enumerate(self.messages):
            if not m.text and not (i == last and m.role == "assistant"):
                raise InvalidRequestError(f"'messages[{i}].content' must not be empty (only a final assistant "
                                          "message may be)", param=f"messages[{i}].content")
        if self.tools:
            raise not_supported("'tools' are not supported yet", param="tools")
        if self.thinking is not None and self.thinking.get("type") != "disabled":
            raise not_supported("extended 'thinking' is not supported yet; send {\"type\": \"disabled\"} or omit it",
                                param="thinking.type")

    def template_messages(self) -> tuple[list[dict[str, str]], bool]:
        """Chat-template messages (system first, same-role turns merged), and whether the last is a prefill."""
        out: list[dict[str, str]] = []
        system = BLOCK_JOIN.join(b.text for b in self.system or [] if b.text)
        if system:
            out.append({"role": "system", "content": system})
        for m in self.messages:
            if out and out[-1]["role"] == m.role:  # Anthropic combines consecutive turns of one role
                out[-1]["content"] = BLOCK_JOIN.join(t for t in (out[-1]["content"], m.text) if t)
            else:
                out.append({"role": m.role, "content": m.text})
        prefill = out[-1]["role"] == "assistant"
        if prefill and not out[-1]["content"]:  # an empty final assistant turn is no prefill
            out.pop()
            prefill = False
        return out, prefill

    @property
    def has_cache_control(self) -> bool:
        blocks = [*(self.system or []), *(b for m in self.messages for b in m.content)]
        return self.cache_control is not None or any(b.cache_control is not None for b in blocks)


class MessagesRequest(OpenAISampling, Conversation):
    """`POST /v1/messages`: Anthropic's fields plus the shared extensions (min_p, penalties, seed, ...)."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    metadata: Metadata | None = None
    tool_choice: dict[str, Any] | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _stop_sequences(cls, v: list[str] | None) -> list[str] | None:
        if v is not None:
            if len(v) > MAX_STOP:
                raise ValueError(f"must hold at most {MAX_STOP} strings")
            if any(not s for s in v):
                raise ValueError("must not contain empty strings")
        return v

    def check(self) -> None:
        self.check_common()
        self.check_conversation()
        if self.max_tokens < 1:
            raise InvalidRequestError("'max_tokens' must be >= 1", param="max_tokens")
        if self.temperature is not None and not 0 <= self.temperature <= 1:
            raise InvalidRequestError("'temperature' must be in [0, 1]", param="temperature")
        if self.n != 1:
            raise InvalidRequestError("'n' must be 1: a message holds one answer", param="n")
        if "stop" in self.model_fields_set:
            raise InvalidRequestError("'stop' is not a Messages field; use 'stop_sequences'", param="stop")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, vocab_size: int) -> SamplingParams:
        """The shared builder, with Anthropic's `stop_sequences` as the stop strings."""
        spelled = self.model_copy(update={"stop": list(self.stop_sequences or [])})
        return OpenAISampling.sampling_params(spelled, max_tokens, logprobs, vocab_size)


class CountTokensRequest(Conversation):
    """`POST /v1/messages/count_tokens`."""


def prompt_ids(conv: Conversation, tokenizer: Any) -> list[int]:
    """Render the turns with the chat template; a final assistant turn with text is continued, not closed."""
    messages, prefill = conv.template_messages()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=not prefill, continue_final_message=prefill)
    return tokenizer.encode(text, add_special_tokens=False)


def usage_json(usage: Usage) -> dict[str, int]:
    """Anthropic usage: input_tokens excludes the prefix-cache hit, which is cache_read_input_tokens."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": usage.cached_tokens}


def stop_reason(finish: str | None, matched: str | int | None, clamped: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for an engine finish; `clamped`: max_tokens was cut to the context left."""
    if finish == "length":
        return ("model_context_window_exceeded" if clamped else "max_tokens"), None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def message_json(mid: str, model: str, text: str | None, reason: tuple[str | None, str | None],
                 usage: dict[str, int]) -> dict[str, Any]:
    """The `message` object; `text` None (a stream's message_start) has no content yet."""
    return {"id": mid, "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": text}] if text is not None else [],
            "stop_reason": reason[0], "stop_sequence": reason[1], "usage": usage}


@bp.post("/v1/messages")
async def messages() -> Any:
    req, engine = await engine_request(MessagesRequest)
    req.check()
    ids = prompt_ids(req, engine.tokenizer)
    check_context(len(ids), None, engine.max_model_len, "messages")
    max_tokens = min(req.max_tokens, engine.max_model_len - len(ids))  # agents send 32k; a small model has less
    params = req.sampling_params(max_tokens, None, engine.vocab_size)
    constraint = await structured.constraint(structured.messages_format(req.output_config), engine, params)
    mid = new_message_id()
    set_response_id(mid)
    greq = GenerationRequest(mid, ids, params, priority=req.priority or 0,
                             cache_prompt=bool(req.cache_prompt) or req.has_cache_control, constraint=constraint)
    events = await lifecycle.begin(engine, greq, bool(req.stream))
    clamped = max_tokens < req.max_tokens
    if req.stream:
        fmt = MessageStream(mid, engine.served_name, len(ids), clamped)
        return sse_response(drive(engine, mid, events, fmt, keepalive_s=PING_INTERVAL_S))
    result = await collect(engine, greq, events)
    c = result.choices[0]
    return jsonify(message_json(mid, engine.served_name, c.text, stop_reason(c.finish_reason, c.stop_reason, clamped),
                                usage_json(result.usage)))


@bp.post("/v1/messages/count_tokens")
async def count_tokens() -> Any:
    req, engine = await engine_request(CountTokensRequest)
    req.check_conversation()
    return jsonify({"input_tokens": len(prompt_ids(req, engine.tokenizer))})


class MessageStream:
    """message_start, ping, one text block (start, text_delta..., stop), message_delta, message_stop."""

    def __init__(self, mid: str, model: str, prompt_tokens: int, clamped: bool):
        self._mid, self._model, self._prompt_tokens, self._clamped = mid, model, prompt_tokens, clamped
        self._finish: str | None = None
        self._matched: str | int | None = None

    def open(self) -> list[str]:
        start_usage = {"input_tokens": self._prompt_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                       "cache_read_input_tokens": 0}  # the cache split is known at the end: message_delta
        message = message_json(self._mid, self._model, None, (None, None), start_usage)
        return [sse({"type": "message_start", "message": message}, "message_start"), *self.ping(),
                sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                    "content_block_start")]

    def event(self, ev: EngineEvent) -> list[str]:
        if ev.finish_reason is not None:
            self._finish, self._matched = ev.finish_reason, ev.stop_reason
        if not ev.text:
            return []
        return [sse({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": ev.text}},
                    "content_block_delta")]

    def close(self, usage: Usage | None) -> list[str]:
        reason, matched = stop_reason(self._finish, self._matched, self._clamped)
        delta_usage = usage_json(usage) if usage is not None else {"output_tokens": 0}
        return [sse({"type": "content_block_stop", "index": 0}, "content_block_stop"),
                sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": matched},
                     "usage": delta_usage}, "message_delta"),
                sse({"type": "message_stop"}, "message_stop")]

    def error(self, err: ImpError) -> list[str]:
        return [sse(anthropic_error_body(err, self._mid), "error")]

    def ping(self) -> list[str]:
        return [sse({"type": "ping"}, "ping")]


@bp.after_app_request
async def _echo_anthropic_headers(response: Response) -> Response:
    """anthropic-version and anthropic-beta are read and echoed back, not enforced; a beta is logged once."""
    if not is_anthropic_path(request.path):
        return response
    for name in ECHOED_HEADERS:
        value = request.headers.get(name)
        if value is not None:
            response.headers[name] = value
    seen: set[str] = current_app.extensions.setdefault(_BETAS_SEEN, set())
    for beta in filter(None, (b.strip() for b in request.headers.get("anthropic-beta", "").split(","))):
        if beta not in seen:
            seen.add(beta)
            log.info("anthropic-beta %r is not implemented here; ignored", beta)
    return response
