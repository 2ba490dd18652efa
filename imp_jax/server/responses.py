"""OpenAI Responses: `POST /v1/responses` (whole or streamed), and `GET` / `DELETE /v1/responses/{id}`.

`store: true` (the default) keeps the finished response and its conversation in the app's
ResponsesStore, so a later request can continue it with `previous_response_id`.
"""
from __future__ import annotations

import functools
import json
import uuid
from typing import Any, ClassVar, Literal

from pydantic import field_validator
from quart import Blueprint, current_app, jsonify
from quart.blueprints import BlueprintSetupState

from imp_jax.errors import InvalidRequestError, NotFoundError
from imp_jax.runtime.request import MAX_TOP_LOGPROBS, ImageInput, check_context
from imp_jax.server import fields, structured
from imp_jax.server.context import caller_owner, default_max_tokens, server, state_of
from imp_jax.server.dialect import Dialect, Plan, serve
from imp_jax.server.errors import not_supported
from imp_jax.server.generation import Completion
from imp_jax.server.image_parts import ImageRef, request_images, responses_image
from imp_jax.server.images import decode
from imp_jax.server.image_prompts import NO_IMAGES, PromptImages
from imp_jax.server.limits import off_loop
from imp_jax.server.logprobs import TokenText, chat_logprobs
from imp_jax.server.openai_common import OpenAISampling
from imp_jax.server.prompts import RESERVED_TEMPLATE_KWARGS, responses_prompt
from imp_jax.server.responses_reply import ResponseDraft, ResponseStream
from imp_jax.server.responses_store import STORE_KEY, ResponsesStore, StoreLimits
from imp_jax.runtime.replies.calls import ParsedReply
from imp_jax.server.tools import NAMESPACE_SEP, ToolPlan, choice_reply, prepare_decoding, responses_plan
from imp_jax.server.validation import WireModel

bp = Blueprint("responses", __name__)
PART_JOIN = "\n"  # the text parts of one input message join with this (as vLLM)
MAX_METADATA = 16  # OpenAI's limits on metadata: keys, key length, value length
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512
LOGPROBS_INCLUDE = "message.output_text.logprobs"
ENCRYPTED_REASONING = "reasoning.encrypted_content"   # what Codex asks for when it does not store responses
INCLUDES = (LOGPROBS_INCLUDE, ENCRYPTED_REASONING)


class InputPart(WireModel):
    """A content part of an input message: `input_text`, `output_text` or `input_image` (anything else is a 400)."""

    type: str
    text: str | None = None
    image_url: Any = None     # input_image: a data: URL (image_parts.responses_image)
    detail: Any = None
    file_id: Any = None

    @field_validator("type")
    @classmethod
    def _known_type(cls, v: str) -> str:
        if v not in ("input_text", "output_text", "input_image"):
            raise ValueError(f"content part type {v!r} is not supported; 'input_text', 'output_text' and "
                             "'input_image' are")
        return v


# Input item types and the fields each needs besides `type`; replayed reasoning items are dropped before
# (ResponsesRequest.input), other types (item references, ...) are a 400.
ITEM_FIELDS = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
               "custom_tool_call": ("call_id", "name", "input"), "function_call_output": ("call_id", "output"),
               "custom_tool_call_output": ("call_id", "output")}


class InputItem(WireModel):
    """A message, a tool call the model made earlier (replayed), or a tool call's output."""

    type: str = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    namespace: str | None = None
    arguments: str | None = None
    input: str | None = None
    output: str | list[dict[str, Any]] | None = None

    @field_validator("type")
    @classmethod
    def _known_type(cls, v: str) -> str:
        if v not in ITEM_FIELDS:
            raise ValueError(f"input item type {v!r} is not supported; {', '.join(map(repr, ITEM_FIELDS))} items are")
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _string_or_parts(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [{"type": "input_text", "text": v}]
        if v is not None and not isinstance(v, list):
            raise ValueError("must be a string or a list of content parts")
        return v

    def check(self, param: str) -> None:
        for field in ITEM_FIELDS[self.type]:
            if getattr(self, field) is None:
                raise InvalidRequestError(f"'{param}.{field}' is required in a {self.type} item",
                                          param=f"{param}.{field}")
        for j, part in enumerate(self.content or []):
            if part.type != "input_image" and part.text is None:
                raise InvalidRequestError(f"'{param}.content[{j}].text' is required in an {part.type} part",
                                          param=f"{param}.content[{j}].text")

    @property
    def text(self) -> str:
        """A message's text, or a tool output's (its text parts)."""
        if self.type == "message":
            return PART_JOIN.join(p.text for p in self.content or [] if p.text and p.type != "input_image")
        if isinstance(self.output, str):
            return self.output
        return PART_JOIN.join(str(p.get("text", "")) for p in self.output or [] if isinstance(p, dict))

    def image_refs(self, param: str) -> list[ImageRef]:
        """A message's input_image parts, or a tool output's, in order."""
        if self.type == "message":
            parts: list[Any] = list(self.content or [])
        else:
            parts = self.output if isinstance(self.output, list) else []
        where = "content" if self.type == "message" else "output"
        return [responses_image(p if isinstance(p, dict) else p.model_dump(), f"{param}.{where}[{j}]")
                for j, p in enumerate(parts) if (p.get("type") if isinstance(p, dict) else p.type) == "input_image"]

    def template_text(self, images: PromptImages, at: str) -> str:
        """`text` with the item's (`input[i]` = `at`) input_image parts as their marks, in place."""
        if self.type == "message":
            parts: list[Any] = [p.model_dump() for p in self.content or []]
        elif isinstance(self.output, list):
            parts = [p for p in self.output if isinstance(p, dict)]
        else:
            return self.text
        where = "content" if self.type == "message" else "output"
        texts = (images.mark(f"{at}.{where}[{j}]") if p.get("type") == "input_image" else str(p.get("text") or "")
                 for j, p in enumerate(parts))
        return PART_JOIN.join(t for t in texts if t)


def conversation_of(items: list[InputItem], images: PromptImages = NO_IMAGES) -> list[dict[str, Any]]:
    """Input items as conversation messages (Chat's shape, image parts as their marks): tool outputs are `tool`
    messages, and replayed calls join the assistant message before them, so one response stays one assistant turn."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if item.type == "message":
            out.append({"role": item.role, "content": item.template_text(images, f"input[{i}]")})
        elif item.type.endswith("_output"):
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": item.template_text(images, f"input[{i}]")})
        else:
            name = f"{item.namespace}{NAMESPACE_SEP}{item.name}" if item.namespace else item.name
            arguments = item.arguments if item.type == "function_call" else json.dumps({"input": item.input})
            call = {"id": item.call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            out[-1]["tool_calls"] = [*out[-1].get("tool_calls", []), call]
    return out


class TextConfig(WireModel):
    format: dict[str, Any] | None = None


class ResponsesRequest(OpenAISampling):
    """`POST /v1/responses`: OpenAI's fields plus the shared extensions (top_k, min_p, penalties, ...)."""

    EXTRAS: ClassVar[frozenset[str]] = fields.SAMPLING_EXTRAS
    REFUSED: ClassVar[dict[str, str]] = {
        "max_tokens": "use 'max_output_tokens'",
        "stream_options": "a Responses stream always ends with its usage (response.completed)"}
    HINTS: ClassVar[dict[str, str]] = {
        **{f: "use 'text.format'" for f in fields.STRUCTURED},
        "logprobs": "send 'top_logprobs' and 'include': [\"message.output_text.logprobs\"]",
        "prompt_logprobs": "prompt logprobs are served on /v1/completions",
        "echo": "echo is served on /v1/completions", "messages": "use 'input'", "system": "use 'instructions'",
        "max_completion_tokens": "use 'max_output_tokens'", "stop_sequences": "use 'stop'",
        "output_config": "use 'text.format'", "output_format": "use 'text.format'",
        "reasoning_effort": "use 'reasoning.effort'", "cache_control": "use 'cache_prompt'"}

    input: list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None   # `effort` reaches the template as `reasoning_effort`
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None
    truncation: str | None = None
    background: bool | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    continue_final_message: bool = False

    @field_validator("input", mode="before")
    @classmethod
    def _string_or_items(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [{"role": "user", "content": v}]
        if not isinstance(v, list):
            raise ValueError("must be a string or a list of input items")
        return [i for i in v if not (isinstance(i, dict) and i.get("type") == "reasoning")]  # replayed: dropped

    @functools.cached_property
    def tool_plan(self) -> ToolPlan:
        return responses_plan(self.tools, self.tool_choice, self.parallel_tool_calls)

    @functools.cached_property
    def output_form(self) -> structured.OutputFormat | None:
        return structured.responses_format(self.text_format)

    def check(self) -> None:
        self.check_common()
        for i, item in enumerate(self.input):
            item.check(f"input[{i}]")
        if not self.input or not any(item.text or item.type != "message" or item.image_refs(f"input[{i}]")
                                     for i, item in enumerate(self.input)):
            raise InvalidRequestError("'input' must hold some text", param="input")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise InvalidRequestError("'max_output_tokens' must be >= 1", param="max_output_tokens")
        if self.n != 1:
            raise InvalidRequestError("'n' must be 1: a response holds one answer", param="n")
        self.tool_plan.check()
        self.tool_plan.admit(self.output_form)
        if self.background:
            raise not_supported("'background' responses are not supported", param="background")
        self._check_include()
        if self.truncation not in (None, "auto", "disabled"):
            raise InvalidRequestError("'truncation' must be 'auto' or 'disabled'", param="truncation")
        self._check_metadata()
        taken = sorted(RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or {}))
        if taken:
            raise InvalidRequestError(f"'chat_template_kwargs.{taken[0]}' may not be set: the request sets it",
                                      param=f"chat_template_kwargs.{taken[0]}")
        if self.continue_final_message:
            last = self.input[-1]
            if last.type != "message" or last.role != "assistant" or not last.text:
                raise InvalidRequestError("'continue_final_message' needs a final assistant message with text",
                                          param="continue_final_message")

    def image_refs(self) -> list[ImageRef]:
        """Every input_image part (tool outputs' too), in body order."""
        return [ref for i, item in enumerate(self.input) for ref in item.image_refs(f"input[{i}]")]

    def _check_include(self) -> None:
        """`include`: `message.output_text.logprobs` and `reasoning.encrypted_content` map to something here
        (INCLUDES); `top_logprobs` needs the first."""
        for i, value in enumerate(self.include or []):
            if value not in INCLUDES:
                raise not_supported(f"'include' value {value[:64]!r} is not supported; only "
                                    f"{' and '.join(repr(v) for v in INCLUDES)} are", param=f"include[{i}]")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise InvalidRequestError(f"'top_logprobs' needs 'include': [\"{LOGPROBS_INCLUDE}\"]",
                                          param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise InvalidRequestError(f"'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs")

    @property
    def encrypted_reasoning(self) -> bool:
        """Whether reasoning items carry `encrypted_content` (what stateless clients such as Codex replay)."""
        return ENCRYPTED_REASONING in (self.include or [])

    @property
    def logprobs(self) -> bool:
        """Whether the output text carries its tokens' logprobs (`include`: message.output_text.logprobs)."""
        return LOGPROBS_INCLUDE in (self.include or [])

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def text_format(self) -> dict[str, Any]:
        """`text.format` as asked (the response echoes it); plain text when unset."""
        return (self.text.format if self.text else None) or {"type": "text"}

    def _check_metadata(self) -> None:
        meta = self.metadata or {}
        if len(meta) > MAX_METADATA:
            raise InvalidRequestError(f"'metadata' may hold at most {MAX_METADATA} pairs", param="metadata")
        for key, value in meta.items():
            if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                raise InvalidRequestError(f"'metadata' keys are at most {MAX_METADATA_KEY} characters and values "
                                          f"at most {MAX_METADATA_VALUE}", param=f"metadata.{key}")


def responses_store() -> ResponsesStore:
    """The running app's store."""
    return current_app.extensions[STORE_KEY]


@bp.record
def _install_store(state: BlueprintSetupState) -> None:
    cfg = state_of(state.app).config
    limits = StoreLimits(ttl_s=cfg.responses_store_ttl_s, max_entries=cfg.responses_store_max_entries,
                         max_bytes=cfg.responses_store_max_bytes)
    state.app.extensions[STORE_KEY] = ResponsesStore(limits)


class ResponsesDialect(Dialect):
    """OpenAI Responses: the stored conversation (`previous_response_id`) and this input through the chat
    template, cut to the context with `truncation: "auto"`; the reply as output items (responses_reply.py),
    stored when finished."""

    body = ResponsesRequest
    req: ResponsesRequest
    tool_format: str | None = None
    draft: ResponseDraft   # the response in the making (made in plan)

    @staticmethod
    def mint_id() -> str:
        return f"resp_{uuid.uuid4().hex}"

    async def plan(self) -> Plan:
        req, engine = self.req, self.engine
        refs = req.image_refs()
        decoded = await request_images(refs, engine, server().config.image_limits)
        previous, earlier = await self._previous()
        images = PromptImages(refs, decoded, earlier)
        conversation = previous + conversation_of(req.input, images)
        ids, in_order = await off_loop(responses_prompt, req, engine, conversation, images)
        check_context(len(ids), None, engine.max_model_len, "input")
        room = engine.max_model_len - len(ids)
        asked = default_max_tokens(req.max_output_tokens, len(ids), engine.max_model_len)
        params = req.sampling_params(room if asked is None else min(asked, room), req.engine_logprobs,
                                     engine.vocab_size)
        constraint, self.tool_format = await prepare_decoding(req.tool_plan, req.output_form, engine, params)
        self.draft = ResponseDraft(self.ctx.response_id, self.ctx.model, req, conversation, responses_store(),
                                   caller_owner(), images.by_digest)
        return Plan(ids, params, bool(req.stream), {**self.scheduling(), "reasoning": True, "constraint": constraint,
                                                    "images": in_order, "tool_calls": self.tool_format is not None})

    async def _previous(self) -> tuple[list[dict[str, Any]], dict[str, ImageInput]]:
        """The stored conversation `previous_response_id` continues (a 404 when there is none of the caller's),
        and its images, decoded again from their stored encoding (the same pixels)."""
        response_id = self.req.previous_response_id
        if response_id is None:
            return [], {}
        entry = responses_store().get(response_id, caller_owner())
        if entry is None:
            raise _not_found(response_id, "previous_response_id")
        limits = server().config.image_limits
        return entry.conversation, {digest: await off_loop(decode, raw, "previous_response_id", limits, detail)
                                    for digest, (raw, detail) in entry.images.items()}

    def _token_text(self) -> TokenText | None:
        return TokenText(self.engine.tokenizer) if self.req.logprobs else None

    def stream(self, plan: Plan) -> ResponseStream:
        return ResponseStream(self.draft, self.tool_format, self._token_text())

    def reply(self, plan: Plan, result: Completion) -> dict[str, Any]:
        c, token_text = result.choices[0], self._token_text()  # calls are parsed out of the answer, never the reasoning
        parsed = choice_reply(c, self.tool_format) if self.tool_format is not None else ParsedReply(c.text, [])
        logprobs = chat_logprobs(c.logprobs or [], token_text) if token_text is not None else None
        return self.draft.finish(parsed.content, c.finish_reason, result.usage, parsed.calls, c.reasoning,
                                 logprobs=logprobs)


@bp.post("/v1/responses")
async def create_response() -> Any:
    return await serve(ResponsesDialect)


def _not_found(response_id: str, param: str) -> NotFoundError:
    return NotFoundError(f"no stored response with id '{response_id}' (never stored, deleted, or expired)",
                         code="response_not_found", param=param)


@bp.get("/v1/responses/<response_id>")
async def retrieve_response(response_id: str) -> Any:
    entry = responses_store().get(response_id, caller_owner())
    if entry is None:
        raise _not_found(response_id, "response_id")
    return jsonify(entry.response)


@bp.delete("/v1/responses/<response_id>")
async def delete_response(response_id: str) -> Any:
    if not responses_store().delete(response_id, caller_owner()):
        raise _not_found(response_id, "response_id")
    return jsonify({"id": response_id, "object": "response", "deleted": True})


