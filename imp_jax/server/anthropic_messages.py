"""Anthropic Messages: `POST /v1/messages` (whole or streamed per token) and `POST /v1/messages/count_tokens`.

Native wire format, no shim through Chat: text, image and tool blocks in (replayed thinking dropped; images
parsed and decoded, then refused while no served model has vision: image_parts.py); thinking
(opted in), text and tool_use blocks out, in that order; Anthropic's stop reasons and usage, its SSE
event sequence with pings (anthropic_reply.py), and its error envelope (errors.py).
"""
from __future__ import annotations

import functools
import json
import logging
import uuid
from typing import Any, ClassVar, Literal

from pydantic import field_validator, model_validator
from quart import Blueprint, Response, current_app, jsonify, request

from imp_jax.errors import InvalidRequestError
from imp_jax.runtime.request import SamplingParams, check_context
from imp_jax.server import fields, structured
from imp_jax.server.anthropic_reply import MessageStream, message_json, stop_reason, usage_json
from imp_jax.server.context import engine_request, granted
from imp_jax.server.dialect import Dialect, Plan, serve
from imp_jax.server.errors import is_anthropic_path
from imp_jax.server.generation import Completion
from imp_jax.server.image_parts import ImageRef, anthropic_image
from imp_jax.server.image_prompts import NO_IMAGES, PromptImages
from imp_jax.server.limits import off_loop
from imp_jax.server.openai_common import MAX_USER_CHARS, OpenAISampling, check_stop_strings
from imp_jax.server.prompts import breakpoint_tokens, messages_prompt, prompt_images
from imp_jax.server.reasoning import Thinking, anthropic_thinking, thinking_block
from imp_jax.server.tools import ToolPlan, anthropic_plan, choice_reply, prepare_decoding
from imp_jax.server.validation import WireModel

bp = Blueprint("anthropic_messages", __name__)
log = logging.getLogger("imp_jax.server")

PING_INTERVAL_S = 10.0  # a ping after this much silence keeps proxies from closing a slow stream
BLOCK_JOIN = "\n"       # text blocks of one turn, and consecutive same-role turns, join with this (as vLLM)
ECHOED_HEADERS = ("anthropic-version", "anthropic-beta")
_BETAS_SEEN = "imp_jax.anthropic_betas"  # app.extensions key: the beta values already logged
MAX_BETAS_SEEN = 64       # beta values remembered (and so logged once each); later new ones are not logged
MAX_BETA_CHARS = 128      # a beta value longer than this is not a real one: not remembered, not logged


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
    thinking = ("thinking", "redacted_thinking")  # replayed thinking: dropped (templates drop past reasoning)
    return v if v is None else [b for b in v if not (isinstance(b, dict) and b.get("type") in thinking)]


class ResultBlock(WireModel):
    """A tool_result's content block: `text` or `image`."""

    type: Literal["text", "image"]
    text: str | None = None
    source: Any = None
    cache_control: dict[str, Any] | None = None


class Block(WireModel):
    """A message's content block: `text`, `image`, `tool_use` (a replayed call) or `tool_result` (documents: a 400)."""

    type: Literal["text", "image", "tool_use", "tool_result"]
    text: str | None = None
    source: Any = None                            # image: {"type": "base64" | "url", ...}
    id: str | None = None                         # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None                # tool_result
    content: str | list[ResultBlock] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _result_string_or_blocks(cls, v: Any) -> Any:
        return v if isinstance(v, str) else _as_blocks(v)

    def check(self, param: str) -> None:
        """The fields each block type needs (a 400 naming the first missing one)."""
        needs = {"text": ("text",), "image": ("source",), "tool_use": ("id", "name", "input"),
                 "tool_result": ("tool_use_id",)}[self.type]
        for field in needs:
            if getattr(self, field) is None:
                raise InvalidRequestError(f"'{param}.{field}' is required in a {self.type} block",
                                          param=f"{param}.{field}")
        for k, b in enumerate(self.content if isinstance(self.content, list) else []):
            if (b.text if b.type == "text" else b.source) is None:
                field = "text" if b.type == "text" else "source"
                raise InvalidRequestError(f"'{param}.content[{k}].{field}' is required in a {b.type} block",
                                          param=f"{param}.content[{k}].{field}")

    def result_text(self, images: PromptImages = NO_IMAGES, at: str = "") -> str:
        """A tool_result's content as text, its image blocks as their marks (the block being `at`)."""
        if isinstance(self.content, str):
            return self.content
        parts = (b.text if b.type == "text" else images.mark(f"{at}.content[{k}]")
                 for k, b in enumerate(self.content or []))
        return BLOCK_JOIN.join(p for p in parts if p)

    def image_refs(self, param: str) -> list[ImageRef]:
        """This block's images: itself, or a tool_result's image blocks."""
        if self.type == "image":
            return [anthropic_image(self.source, param)]
        if self.type == "tool_result" and isinstance(self.content, list):
            return [anthropic_image(b.source, f"{param}.content[{k}]")
                    for k, b in enumerate(self.content) if b.type == "image"]
        return []


class Message(WireModel):
    role: Literal["user", "assistant"]
    content: list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _string_or_blocks(cls, v: Any) -> Any:
        return _as_blocks(v)

    @property
    def text(self) -> str:
        return BLOCK_JOIN.join(b.text for b in self.content if b.type == "text" and b.text)

    def chat_messages(self, images: PromptImages = NO_IMAGES, at: str = "") -> list[dict[str, Any]]:
        """This turn (`messages[i]` = `at`) in Chat's shape: tool results become `tool` messages (before the
        turn's text), tool_use blocks the assistant turn's `tool_calls`, image blocks their marks in the text."""
        out: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": b.tool_use_id,
                                      "content": b.result_text(images, f"{at}.content[{j}]")}
                                     for j, b in enumerate(self.content) if b.type == "tool_result"]
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in self.content if b.type == "tool_use"]
        parts = ((b.text if b.type == "text" else images.mark(f"{at}.content[{j}]"))
                 for j, b in enumerate(self.content) if b.type in ("text", "image"))
        text = BLOCK_JOIN.join(p for p in parts if p)
        if text or calls or not out:
            out.append({"role": self.role, "content": text, **({"tool_calls": calls} if calls else {})})
        return out


class Metadata(WireModel):
    user_id: str | None = None

    @field_validator("user_id")
    @classmethod
    def _user_id(cls, v: str | None) -> str | None:
        if v is not None and len(v) > MAX_USER_CHARS:
            raise ValueError(f"must be at most {MAX_USER_CHARS} characters")
        return v

    @model_validator(mode="after")
    def _no_other_keys(self) -> Metadata:
        if self.model_extra:   # Anthropic's metadata has user_id only; anything else would be kept unbounded
            raise ValueError(f"holds unknown key {sorted(self.model_extra)[0][:64]!r}; only 'user_id' is accepted")
        return self


class Conversation(WireModel):
    """What /v1/messages and count_tokens share: the model, the system prompt and the turns."""

    model: str
    messages: list[Message]
    system: list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None  # top level: a breakpoint on the last cacheable block
    output_config: dict[str, Any] | None = None  # `format`: JSON outputs (structured.py); `effort` is ignored

    @field_validator("system", mode="before")
    @classmethod
    def _system_string_or_blocks(cls, v: Any) -> Any:
        return _as_blocks(v)

    def image_refs(self) -> list[ImageRef]:
        """Every image block (tool results' too), in body order."""
        return [ref for i, m in enumerate(self.messages) for j, b in enumerate(m.content)
                for ref in b.image_refs(f"messages[{i}].content[{j}]")]

    def check_conversation(self) -> None:
        """Anthropic's rules: at least one turn, none empty but a final assistant prefill."""
        if not self.messages:
            raise InvalidRequestError("'messages' must hold at least one message", param="messages")
        last = len(self.messages) - 1
        for i, m in enumerate(self.messages):
            for j, b in enumerate(m.content):
                b.check(f"messages[{i}].content[{j}]")
            empty = not m.text and not any(b.type != "text" for b in m.content)
            if empty and not (i == last and m.role == "assistant"):
                raise InvalidRequestError(f"'messages[{i}].content' must not be empty (only a final assistant "
                                          "message may be)", param=f"messages[{i}].content")
        self.tool_plan.check()
        anthropic_thinking(self.thinking)

    @functools.cached_property
    def tool_plan(self) -> ToolPlan:
        return anthropic_plan(self.tools, self.tool_choice)

    def template_messages(self, images: PromptImages = NO_IMAGES) -> tuple[list[dict[str, Any]], bool]:
        """Chat-template messages (system first, same-role turns merged, image blocks as their marks), and
        whether the last is a prefill."""
        out: list[dict[str, Any]] = []
        system = BLOCK_JOIN.join(b.text for b in self.system or [] if b.text)
        if system:
            out.append({"role": "system", "content": system})
        turns = (m.chat_messages(images, f"messages[{i}]") for i, m in enumerate(self.messages))
        for msg in (chat for turn in turns for chat in turn):
            prev = out[-1] if out else None
            if prev is not None and prev["role"] == msg["role"] != "tool":  # Anthropic combines same-role turns
                prev["content"] = BLOCK_JOIN.join(t for t in (prev["content"], msg["content"]) if t)
                if msg.get("tool_calls"):
                    prev["tool_calls"] = prev.get("tool_calls", []) + msg["tool_calls"]
            else:
                out.append(msg)
        prefill = out[-1]["role"] == "assistant" and not out[-1].get("tool_calls")
        if prefill and not out[-1]["content"]:  # an empty final assistant turn is no prefill
            out.pop()
            prefill = False
        return out, prefill

    def through_breakpoint(self) -> Conversation | None:
        """The conversation up to and including the last block carrying `cache_control` (Anthropic's order:
        tools, system, messages; a tool_result counts its inner blocks' marks); None when the cached region
        is the whole prompt (a top-level `cache_control`, a mark on a tool only, or none)."""
        if self.cache_control is not None:
            return None
        for i in reversed(range(len(self.messages))):
            content = self.messages[i].content
            for j in reversed(range(len(content))):
                b = content[j]
                inner = b.content if isinstance(b.content, list) else []
                if b.cache_control is not None or any(t.cache_control is not None for t in inner):
                    cut = self.messages[i].model_copy(update={"content": content[:j + 1]})
                    return self.model_copy(update={"messages": [*self.messages[:i], cut]})
        system = self.system or []
        for k in reversed(range(len(system))):
            if system[k].cache_control is not None:
                return self.model_copy(update={"system": system[:k + 1], "messages": []})
        return None

    @property
    def has_cache_control(self) -> bool:
        blocks = [*(self.system or []), *(b for m in self.messages for b in m.content)]
        return self.cache_control is not None or any(b.cache_control is not None for b in blocks)


class MessagesRequest(OpenAISampling, Conversation):
    """`POST /v1/messages`: Anthropic's fields plus the shared extensions (min_p, penalties, seed, ...)."""

    EXTRAS: ClassVar[frozenset[str]] = fields.SAMPLING_EXTRAS
    REFUSED: ClassVar[dict[str, str]] = {
        "stop": "use 'stop_sequences'", "user": "use 'metadata.user_id'",
        "stream_options": "a Messages stream always ends with its usage (message_delta)"}
    HINTS: ClassVar[dict[str, str]] = {
        **{f: "use 'output_config.format' ({\"type\": \"json_schema\", \"schema\": ...})"
           for f in fields.STRUCTURED},
        **{f: "logprobs are served on /v1/chat/completions and /v1/completions" for f in fields.LOGPROBS},
        "max_completion_tokens": "use 'max_tokens'", "instructions": "use 'system'",
        "parallel_tool_calls": "use 'tool_choice.disable_parallel_tool_use'",
        "enable_thinking": "use 'thinking'", "reasoning_effort": "use 'thinking'",
        "chat_template_kwargs": "use 'thinking'", "text": "use 'output_config.format'"}

    max_tokens: int
    stop_sequences: list[str] | None = None
    metadata: Metadata | None = None
    output_format: dict[str, Any] | None = None   # the structured-outputs beta's spelling of output_config.format

    @field_validator("stop_sequences")
    @classmethod
    def _stop_sequences(cls, v: list[str] | None) -> list[str] | None:
        if v is not None:
            check_stop_strings(v)
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
        self.tool_plan.admit(self.output_form)

    @functools.cached_property
    def output_form(self) -> structured.OutputFormat | None:
        return structured.messages_format(self.output_config, self.output_format)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, vocab_size: int) -> SamplingParams:
        """The shared builder, with Anthropic's `stop_sequences` as the stop strings."""
        spelled = self.model_copy(update={"stop": list(self.stop_sequences or [])})
        return OpenAISampling.sampling_params(spelled, max_tokens, logprobs, vocab_size)


class CountTokensRequest(Conversation):
    """`POST /v1/messages/count_tokens`."""


class MessagesDialect(Dialect):
    """Anthropic Messages: the turns through the chat template (a final assistant turn is a prefill), the
    prompt pinned to its last cache_control breakpoint where granted, thinking opted in; the reply
    (anthropic_reply.py) in content blocks, streamed with pings."""

    body = MessagesRequest
    req: MessagesRequest
    tool_format: str | None = None
    clamped = False   # max_tokens was cut to the context left
    thinking: Thinking   # the `thinking` opt-in (anthropic_thinking)

    @staticmethod
    def mint_id() -> str:
        return new_message_id()

    def keepalive_s(self) -> float | None:
        return PING_INTERVAL_S

    async def plan(self) -> Plan:
        req, engine = self.req, self.engine
        images = await prompt_images(req, engine)
        ids, in_order = await off_loop(messages_prompt, req, engine, images)
        check_context(len(ids), None, engine.max_model_len, "messages")
        max_tokens = min(req.max_tokens, engine.max_model_len - len(ids))  # agents send 32k; a small model has less
        self.clamped = max_tokens < req.max_tokens
        params = req.sampling_params(max_tokens, None, engine.vocab_size)
        constraint, self.tool_format = await prepare_decoding(req.tool_plan, req.output_form, engine, params)
        self.thinking = anthropic_thinking(req.thinking)  # without the opt-in a think block is left out of the reply
        marked = not req.cache_prompt and req.has_cache_control and granted("pins")   # pinned to the last breakpoint
        pin_tokens = await off_loop(breakpoint_tokens, req, engine, ids, images) if marked else None
        return Plan(ids, params, bool(req.stream), {
            "priority": req.priority or 0, "cache_prompt": bool(req.cache_prompt) or marked,
            "cache_prompt_tokens": pin_tokens, "constraint": constraint, "reasoning": True,
            "reasoning_budget": self.thinking.budget_tokens, "images": in_order,
            "tool_calls": self.tool_format is not None})

    def stream(self, plan: Plan) -> MessageStream:
        thinking = self.thinking
        shown = thinking if thinking.enabled and self.engine.thinks else None
        return MessageStream(self.ctx.response_id, self.ctx.model, len(plan.ids), self.clamped, self.tool_format,
                             shown)

    def reply(self, plan: Plan, result: Completion) -> dict[str, Any]:
        c, thinking = result.choices[0], self.thinking
        text, calls = c.text, []
        if self.tool_format is not None:  # calls are parsed out of the answer, never the reasoning
            parsed = choice_reply(c, self.tool_format)
            text, calls = parsed.content, parsed.calls
        reason = stop_reason(c.finish_reason, c.stop_reason, self.clamped, bool(calls))
        block = thinking_block(c.reasoning, thinking) if thinking.enabled and c.reasoning else None
        return message_json(self.ctx.response_id, self.ctx.model, text, reason, usage_json(result.usage), calls, block)


@bp.post("/v1/messages")
async def messages() -> Any:
    return await serve(MessagesDialect)


@bp.post("/v1/messages/count_tokens")
async def count_tokens() -> Any:
    req, ctx = await engine_request(CountTokensRequest)
    req.check_conversation()
    images = await prompt_images(req, ctx.engine)
    return jsonify({"input_tokens": len((await off_loop(messages_prompt, req, ctx.engine, images))[0])})


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
        if beta not in seen and len(beta) <= MAX_BETA_CHARS and len(seen) < MAX_BETAS_SEEN:
            seen.add(beta)
            log.info("anthropic-beta %r is not implemented here; ignored", beta)
    return response
