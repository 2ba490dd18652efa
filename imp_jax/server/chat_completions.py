"""OpenAI Chat Completions: `POST /v1/chat/completions`, streamed per token or whole."""
from __future__ import annotations

import functools
from typing import Any, ClassVar, Literal

from pydantic import field_validator
from quart import Blueprint

from imp_jax.errors import InvalidRequestError
from imp_jax.runtime.request import MAX_CFG_SCALE, MAX_TOP_LOGPROBS, EngineEvent
from imp_jax.server import fields, structured
from imp_jax.server.dialect import Dialect, Plan, serve
from imp_jax.server.generation import Choice, Completion
from imp_jax.server.image_parts import VIDEO_URL_REFUSED, ImageRef, openai_image, video_frames
from imp_jax.server.image_prompts import NO_IMAGES, PromptImages
from imp_jax.server.limits import off_loop
from imp_jax.server.logprobs import TokenText, chat_logprobs
from imp_jax.server.openai_common import OpenAISampling, OpenAIStream, new_id, now, usage_json
from imp_jax.server.prompts import RESERVED_TEMPLATE_KWARGS, SYSTEM_ROLES, cfg_shadow_prompt, chat_prompt, prompt_images
from imp_jax.runtime.replies.call_parser import ToolCallParser
from imp_jax.runtime.replies.calls import ArgsDelta, CallStart, TextDelta
from imp_jax.runtime.replies.tool_calls import PARSERS
from imp_jax.server.tools import ToolPlan, chat_plan, choice_reply, event_answer, prepare_decoding
from imp_jax.server.validation import WireModel

bp = Blueprint("chat_completions", __name__)


class ContentPart(WireModel):
    """A content part: `text`, `image_url` or `video` (client-extracted frames); others are a 400 naming the part."""

    type: str
    text: str = ""
    image_url: Any = None    # image_url parts: {"url": ..., "detail": ...} (image_parts.openai_image)
    video: Any = None        # video parts: [frame URLs]

    @field_validator("type")
    @classmethod
    def _known_type(cls, v: str) -> str:
        if v == "video_url":
            raise ValueError(VIDEO_URL_REFUSED)
        if v not in ("text", "image_url", "video"):
            raise ValueError(f"content part type {v!r} is not supported; 'text', 'image_url' and 'video' parts are")
        return v

    def image_refs(self, param: str) -> list[ImageRef]:
        """This part's images (a video's frames), none for text."""
        if self.type == "image_url":
            return [openai_image(self.image_url, param)]
        return video_frames(self.video, param) if self.type == "video" else []


class ChatMessage(WireModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None   # replayed reasoning: the template renders or drops it
    reasoning: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _string_or_parts(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [{"type": "text", "text": v}]
        if v is not None and not isinstance(v, list):
            raise ValueError("must be a string or a list of content parts")
        return v

    @property
    def text(self) -> str | None:
        return None if self.content is None else "".join(p.text for p in self.content if p.type == "text")

    def for_template(self, images: PromptImages = NO_IMAGES, at: str = "") -> dict[str, Any]:
        """The message as chat templates expect it: string content (each image part as its marks, the
        message being `messages[i]` = `at`), developer spelled system."""
        content = "".join(p.text if p.type == "text" else images.mark(f"{at}.content[{j}]")
                          for j, p in enumerate(self.content or []))
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        for key in ("name", "tool_calls", "tool_call_id", "reasoning_content", "reasoning"):
            if getattr(self, key) is not None:
                msg[key] = getattr(self, key)
        return msg


class ChatRequest(OpenAISampling, structured.OutputFormatFields):
    EXTRAS: ClassVar[frozenset[str]] = fields.SAMPLING_EXTRAS
    HINTS: ClassVar[dict[str, str]] = {
        "prompt_logprobs": "prompt logprobs are served on /v1/completions",
        "echo": "echo is served on /v1/completions", "stop_sequences": "use 'stop'",
        "max_output_tokens": "use 'max_completion_tokens'", "text": "use 'response_format'",
        "output_config": "use 'response_format'", "output_format": "use 'response_format'",
        "system": "put a system message in 'messages'", "instructions": "put a system message in 'messages'",
        "cache_control": "use 'cache_prompt'"}

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None      # shorthand for chat_template_kwargs.enable_thinking
    reasoning_effort: str | None = None      # reaches the template as `reasoning_effort`
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logit_lens: Any = None                   # true = top 5, 1..20 = top N per layer; implies logprobs
    cfg_scale: float | None = None           # classifier-free guidance, [1, 10], 1 = off
    cfg_negative_prompt: str | None = None   # the shadow's system message (else the conversation without one)

    def check(self) -> None:
        self.check_common()
        if not self.messages:
            raise InvalidRequestError("'messages' must hold at least one message", param="messages")
        for i, m in enumerate(self.messages):
            if m.content is None and not (m.role == "assistant" and m.tool_calls):
                raise InvalidRequestError(f"'messages[{i}].content' is required for a {m.role} message",
                                          param=f"messages[{i}].content")
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            raise InvalidRequestError("'max_completion_tokens' must be >= 1", param="max_completion_tokens")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise InvalidRequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise InvalidRequestError(f"'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs")
        lens = self.logit_lens
        if lens is not None and not isinstance(lens, bool) and not (
                isinstance(lens, int) and 0 <= lens <= MAX_TOP_LOGPROBS):
            raise InvalidRequestError(f"'logit_lens' must be true, false or in [1, {MAX_TOP_LOGPROBS}]",
                                      param="logit_lens")
        self._check_cfg()
        self.tool_plan.check()
        self.tool_plan.admit(self.output_form)
        if self.continue_final_message:
            self._check_continue()
        taken = sorted(RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or {}))
        if taken:
            names = ", ".join(f"'chat_template_kwargs.{k}'" for k in taken)
            raise InvalidRequestError(f"{names} may not be set: the request's own fields set them",
                                      param=f"chat_template_kwargs.{taken[0]}")

    def image_refs(self) -> list[ImageRef]:
        """Every image part (and video frame), in body order."""
        return [ref for i, m in enumerate(self.messages) for j, p in enumerate(m.content or [])
                for ref in p.image_refs(f"messages[{i}].content[{j}]")]

    def _check_cfg(self) -> None:
        """cfg_scale in [1, 10]; on (> 1) it needs a system message or cfg_negative_prompt, and takes no tools
        or banned strings."""
        if self.cfg_scale is None:
            return
        if not 1 <= self.cfg_scale <= MAX_CFG_SCALE:
            raise InvalidRequestError(f"'cfg_scale' must be in [1, {MAX_CFG_SCALE:g}] (1 = off)", param="cfg_scale")
        if self.cfg_scale == 1:
            return
        if self.cfg_negative_prompt is None and not any(m.role in SYSTEM_ROLES for m in self.messages):
            raise InvalidRequestError("'cfg_scale' needs a system message (the guidance leaves it out) or "
                                      "'cfg_negative_prompt'", param="cfg_scale")
        if self.tools:
            raise InvalidRequestError("'cfg_scale' cannot be combined with 'tools'", param="cfg_scale")
        if any(p.type != "text" for m in self.messages for p in m.content or []):
            raise InvalidRequestError("'cfg_scale' cannot be combined with image or video parts", param="cfg_scale")
        extra = self.model_extra or {}
        for name in ("banned_strings", "banned_regex"):
            if getattr(self, name, None) or extra.get(name):
                raise InvalidRequestError(f"'cfg_scale' cannot be combined with '{name}'", param="cfg_scale")

    @property
    def lens_top(self) -> int | None:
        """logit_lens' top N, None when off."""
        if isinstance(self.logit_lens, bool):
            return 5 if self.logit_lens else None
        return self.logit_lens or None

    @property
    def guided(self) -> bool:
        return self.cfg_scale is not None and self.cfg_scale != 1

    def _check_continue(self) -> None:
        """continue_final_message: the last message is an assistant turn with text and no tool calls."""
        if "add_generation_prompt" in self.model_fields_set and self.add_generation_prompt:
            raise InvalidRequestError("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                                      param="continue_final_message")
        last = self.messages[-1]
        if last.role != "assistant" or not last.text or last.tool_calls:
            raise InvalidRequestError("'continue_final_message' needs a final assistant message with text "
                                      "and no tool_calls", param="continue_final_message")

    @functools.cached_property
    def tool_plan(self) -> ToolPlan:
        return chat_plan(self.tools, self.tool_choice, self.parallel_tool_calls)

    @functools.cached_property
    def output_form(self) -> structured.OutputFormat | None:
        return self.output_format()

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs or self.lens_top else None


class ChatDialect(Dialect):
    """OpenAI Chat: the conversation through the chat template (images, tools, cfg_scale's shadow prompt),
    answered as `chat.completion` or its chunks; tool calls parsed out of each choice's answer."""

    body = ChatRequest
    req: ChatRequest
    tool_format: str | None = None

    @staticmethod
    def mint_id() -> str:
        return new_id("chatcmpl")

    async def plan(self) -> Plan:
        req, engine = self.req, self.engine
        images = await prompt_images(req, engine)
        ids, in_order = await off_loop(chat_prompt, req, engine, images)
        params = req.sampling_params(self.max_tokens(ids, req.max_new_tokens, "messages"), req.engine_logprobs,
                                     engine.vocab_size)
        params.logit_lens = req.lens_top
        shadow_ids = await off_loop(cfg_shadow_prompt, req, engine)
        constraint, self.tool_format = await prepare_decoding(req.tool_plan, req.output_form, engine, params)
        return Plan(ids, params, bool(req.stream), {**self.scheduling(), "reasoning": True, "constraint": constraint,
                                                    "cfg_scale": req.cfg_scale or 1.0, "cfg_prompt_ids": shadow_ids,
                                                    "images": in_order, "tool_calls": self.tool_format is not None})

    def stream(self, plan: Plan) -> ChatStream:
        return ChatStream(self.ctx.response_id, self.ctx.model, plan.params.n, self.req.include_usage,
                          TokenText(self.engine.tokenizer), self.tool_format)

    def reply(self, plan: Plan, result: Completion) -> dict[str, Any]:
        return chat_response(self.ctx.response_id, self.ctx.model, result, TokenText(self.engine.tokenizer),
                             bool(self.req.logprobs or self.req.lens_top), self.tool_format)


@bp.post("/v1/chat/completions")
async def chat_completions() -> Any:
    return await serve(ChatDialect)


def chat_response(rid: str, model: str, result: Completion, token_text: TokenText, logprobs: bool,
                  tool_format: str | None = None) -> dict[str, Any]:
    """The non-streamed `chat.completion` object; with tools offered, calls parsed out of each choice's text."""
    return {
        "id": rid, "object": "chat.completion", "created": now(), "model": model, "system_fingerprint": None,
        "choices": [{
            "index": c.index,
            **_message(c, tool_format),
            "logprobs": {"content": chat_logprobs(c.logprobs, token_text)} if logprobs else None,
            "stop_reason": c.stop_reason,
        } for c in result.choices],
        "usage": usage_json(result.usage),
    }


def _message(c: Choice, tool_format: str | None) -> dict[str, Any]:
    """A choice's `message` (reasoning_content, content, tool_calls) and `finish_reason` (`tool_calls` when it
    made calls and stopped by itself). Calls are parsed out of the answer only, never the reasoning."""
    message: dict[str, Any] = {"role": "assistant", **({"reasoning_content": c.reasoning} if c.reasoning else {})}
    reply = choice_reply(c, tool_format) if tool_format is not None else None
    if reply is None or not reply.calls:
        message["content"] = c.text if reply is None else reply.content
        return {"message": message, "finish_reason": c.finish_reason}
    message["content"] = reply.content.strip() or None
    message["tool_calls"] = [{"id": call.id, "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}} for call in reply.calls]
    return {"message": message, "finish_reason": "tool_calls" if c.finish_reason == "stop" else c.finish_reason}


class ChatStream(OpenAIStream):
    """`chat.completion.chunk` frames: a role chunk per choice, reasoning_content, content and tool_calls deltas,
    a finish chunk, usage, [DONE]."""

    object_name = "chat.completion.chunk"

    def __init__(self, rid: str, model: str, n: int, include_usage: bool, token_text: TokenText,
                 tool_format: str | None = None):
        super().__init__(rid, model, include_usage)
        self._n, self._token_text = n, token_text
        self._opened: set[int] = set()
        self._answers = {i: _AnswerDeltas(tool_format) for i in range(n)}

    def event(self, ev: EngineEvent) -> list[str]:
        frames = []
        if ev.index not in self._opened:
            self._opened.add(ev.index)
            frames.append(self._chunk([{"index": ev.index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]))
        finish, answer = ev.finish_reason, self._answers[ev.index]
        deltas = [{"reasoning_content": ev.reasoning_text}] if ev.reasoning_text else []
        deltas += answer.feed(ev)  # calls are parsed out of the answer only
        if answer.calls and finish == "stop":
            finish = "tool_calls"
        for delta in deltas[:-1]:
            frames.append(self._chunk([{"index": ev.index, "delta": delta, "logprobs": None, "finish_reason": None}]))
        if deltas or ev.logprobs or finish is not None:
            choice: dict[str, Any] = {"index": ev.index, "delta": deltas[-1] if deltas else {},
                                      "logprobs": None, "finish_reason": finish}
            if ev.logprobs:
                choice["logprobs"] = {"content": chat_logprobs(ev.logprobs, self._token_text)}
            if finish is not None:
                choice["stop_reason"] = ev.stop_reason
            frames.append(self._chunk([choice]))
        return frames


class _AnswerDeltas:
    """One choice's streamed answer as Chat deltas: content, and with tools offered `tool_calls` (id and name
    first, then arguments)."""

    def __init__(self, tool_format: str | None):
        self._parser: ToolCallParser | None = PARSERS[tool_format]() if tool_format else None
        self._index: dict[int, int] = {}  # the parser's call index -> the wire's

    @property
    def calls(self) -> int:
        return len(self._index)

    def feed(self, ev: EngineEvent) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for e in event_answer(self._parser, ev):
            if isinstance(e, TextDelta):
                deltas.append({"content": e.text})
            elif isinstance(e, CallStart):
                self._index[e.index] = len(self._index)
                deltas.append({"tool_calls": [{"index": self._index[e.index], "id": e.id, "type": "function",
                                               "function": {"name": e.name, "arguments": ""}}]})
            elif isinstance(e, ArgsDelta):
                deltas.append({"tool_calls": [{"index": self._index[e.index], "function": {"arguments": e.text}}]})
        return deltas

