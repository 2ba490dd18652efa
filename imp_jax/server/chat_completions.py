"""OpenAI Chat Completions: `POST /v1/chat/completions`, streamed per token or whole."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import field_validator
from quart import Blueprint, jsonify

from imp_jax.errors import InvalidRequestError
from imp_jax.runtime.request import MAX_TOP_LOGPROBS, EngineEvent, GenerationRequest, check_context
from imp_jax.server import lifecycle, structured
from imp_jax.server.context import default_max_tokens, engine_request, set_response_id
from imp_jax.server.errors import not_supported
from imp_jax.server.generation import Completion, collect
from imp_jax.server.logprobs import TokenText, chat_logprobs
from imp_jax.server.openai_common import OpenAISampling, OpenAIStream, new_id, now, usage_json
from imp_jax.server.streaming import drive, sse_response
from imp_jax.server.validation import WireModel

bp = Blueprint("chat_completions", __name__)


class TextPart(WireModel):
    type: str
    text: str = ""

    @field_validator("type")
    @classmethod
    def _text_only(cls, v: str) -> str:
        if v != "text":
            raise ValueError(f"content part type {v!r} is not supported; only 'text' parts are")
        return v


class ChatMessage(WireModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

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
        return None if self.content is None else "".join(p.text for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: string content, developer spelled system."""
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": self.text if self.content is not None else ""}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                msg[key] = getattr(self, key)
        return msg


# apply_chat_template's own parameters: a template variable of these names would clash with them
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "continue_final_message", "tools",
                                      "documents", "template_name"})


class ChatRequest(OpenAISampling, structured.OutputFormatFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

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
        if self.tools:
            raise not_supported("'tools' are not supported yet", param="tools")
        if self.continue_final_message:
            self._check_continue()
        taken = sorted(RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or {}))
        if taken:
            names = ", ".join(f"'chat_template_kwargs.{k}'" for k in taken)
            raise InvalidRequestError(f"{names} may not be set: the request's own fields set them",
                                      param=f"chat_template_kwargs.{taken[0]}")

    def _check_continue(self) -> None:
        """continue_final_message: the last message is an assistant turn with text and no tool calls."""
        if "add_generation_prompt" in self.model_fields_set and self.add_generation_prompt:
            raise InvalidRequestError("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                                      param="continue_final_message")
        last = self.messages[-1]
        if last.role != "assistant" or not last.text or last.tool_calls:
            raise InvalidRequestError("'continue_final_message' needs a final assistant message with text "
                                      "and no tool_calls", param="continue_final_message")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def prompt_ids(req: ChatRequest, tokenizer: Any) -> list[int]:
    """Render the conversation with the model's chat template and tokenize it."""
    cont = req.continue_final_message
    text = tokenizer.apply_chat_template(
        [m.for_template() for m in req.messages], add_generation_prompt=req.add_generation_prompt and not cont,
        continue_final_message=cont, **(req.chat_template_kwargs or {}))
    return tokenizer.encode(text, add_special_tokens=False)


@bp.post("/v1/chat/completions")
async def chat_completions() -> Any:
    req, engine = await engine_request(ChatRequest)
    req.check()
    ids = prompt_ids(req, engine.tokenizer)
    check_context(len(ids), req.max_new_tokens, engine.max_model_len, "messages")
    max_tokens = default_max_tokens(req.max_new_tokens, len(ids), engine.max_model_len)
    params = req.sampling_params(max_tokens, req.engine_logprobs, engine.vocab_size)
    constraint = await structured.constraint(req.output_format(), engine, params)
    rid = new_id("chatcmpl")
    set_response_id(rid)
    greq = GenerationRequest(rid, ids, params, priority=req.priority or 0, cache_prompt=bool(req.cache_prompt),
                             constraint=constraint)
    events = await lifecycle.begin(engine, greq, bool(req.stream))
    token_text = TokenText(engine.tokenizer)
    if req.stream:
        fmt = ChatStream(rid, engine.served_name, params.n, req.include_usage, token_text)
        return sse_response(drive(engine, rid, events, fmt))
    result = await collect(engine, greq, events)
    return jsonify(chat_response(rid, engine.served_name, result, token_text, bool(req.logprobs)))


def chat_response(rid: str, model: str, result: Completion, token_text: TokenText, logprobs: bool) -> dict[str, Any]:
    """The non-streamed `chat.completion` object."""
    return {
        "id": rid, "object": "chat.completion", "created": now(), "model": model, "system_fingerprint": None,
        "choices": [{
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": {"content": chat_logprobs(c.logprobs, token_text)} if logprobs else None,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
        } for c in result.choices],
        "usage": usage_json(result.usage),
    }


class ChatStream(OpenAIStream):
    """`chat.completion.chunk` frames: a role chunk per choice, content deltas, a finish chunk, usage, [DONE]."""

    object_name = "chat.completion.chunk"

    def __init__(self, rid: str, model: str, n: int, include_usage: bool, token_text: TokenText):
        super().__init__(rid, model, include_usage)
        self._n, self._token_text = n, token_text
        self._opened: set[int] = set()

    def event(self, ev: EngineEvent) -> list[str]:
        frames = []
        if ev.index not in self._opened:
            self._opened.add(ev.index)
            frames.append(self._chunk([{"index": ev.index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]))
        if ev.text or ev.logprobs or ev.finish_reason is not None:
            choice: dict[str, Any] = {"index": ev.index, "delta": {"content": ev.text} if ev.text else {},
                                      "logprobs": None, "finish_reason": ev.finish_reason}
            if ev.logprobs:
                choice["logprobs"] = {"content": chat_logprobs(ev.logprobs, self._token_text)}
            if ev.finish_reason is not None:
                choice["stop_reason"] = ev.stop_reason
            frames.append(self._chunk([choice]))
        return frames

