"""OpenAI Responses: `POST /v1/responses` (whole or streamed), and `GET` / `DELETE /v1/responses/{id}`.

`store: true` (the default) keeps the finished response and its conversation in the app's
ResponsesStore, so a later request can continue it with `previous_response_id`.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import uuid
from typing import Any, ClassVar, Literal

from pydantic import field_validator
from quart import Blueprint, current_app, jsonify
from quart.blueprints import BlueprintSetupState

from imp_jax.errors import ImpError, InvalidRequestError, NotFoundError
from imp_jax.runtime.request import MAX_TOP_LOGPROBS, EngineEvent, GenerationRequest, ImageInput, Usage, check_context
from imp_jax.server import fields, lifecycle, structured
from imp_jax.server.chat_completions import RESERVED_TEMPLATE_KWARGS
from imp_jax.server.context import (answering_model, caller_owner, default_max_tokens, engine_request, server,
                                   set_response_id, state_of)
from imp_jax.server.errors import not_supported
from imp_jax.server.generation import collect
from imp_jax.server.image_parts import ImageRef, request_images, responses_image
from imp_jax.server.images import decode
from imp_jax.server.image_prompts import NO_IMAGES, PromptImages, count_marks, expand
from imp_jax.server.limits import check_chars, json_reply, off_loop
from imp_jax.server.logprobs import TokenText, chat_logprobs
from imp_jax.server.openai_common import OpenAISampling, now
from imp_jax.server.reasoning import reasoning_item, reasoning_part, template_kwargs
from imp_jax.server.responses_store import STORE_KEY, ResponsesStore, StoreLimits
from imp_jax.server.streaming import drive, sse, sse_response
from imp_jax.runtime.replies.calls import ArgsDelta, CallEnd, CallStart, ParsedReply, TextDelta, ToolCall
from imp_jax.runtime.replies.tool_calls import PARSERS
from imp_jax.server.tools import (NAMESPACE_SEP, ToolPlan, choice_reply, event_answer, prepare_decoding, render_prompt,
                                  responses_plan)
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


def usage_json(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens, **(usage.spec or {})},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def output_text(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


@dataclasses.dataclass
class ResponseDraft:
    """A response in the making: what its object echoes from the request, and where it is kept when done."""

    id: str
    model: str
    req: ResponsesRequest
    conversation: list[dict[str, Any]]  # the previous conversation plus this input
    store: ResponsesStore
    owner: str | None = None   # the API key's digest (responses_store.StoredResponse.owner)
    images: dict[str, ImageInput] = dataclasses.field(default_factory=dict)   # the conversation's, by digest
    created_at: int = dataclasses.field(default_factory=now)
    item_id: str = dataclasses.field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    reasoning_id: str = dataclasses.field(default_factory=lambda: f"rs_{uuid.uuid4().hex}")

    def item(self, text: str | None, status: str, item_id: str | None = None,
             logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The assistant message output item; `text` None: no content part yet."""
        return {"type": "message", "id": item_id or self.item_id, "status": status, "role": "assistant",
                "content": [] if text is None else [output_text(text, logprobs)]}

    def call_item(self, call: ToolCall, status: str, item_id: str | None = None) -> dict[str, Any]:
        """A call's output item: `custom_tool_call` (its `input` text) for a custom tool, else `function_call`;
        a namespaced tool's call carries its namespace."""
        tool = self.req.tool_plan.find(call.name)
        name = tool.local_name or tool.name if tool is not None else call.name
        extra = {"namespace": tool.namespace} if tool is not None and tool.namespace else {}
        if tool is not None and tool.custom:
            return {"type": "custom_tool_call", "id": item_id or f"ctc_{uuid.uuid4().hex}", "status": status,
                    "call_id": call.id, "name": name, "input": custom_input(call.arguments), **extra}
        return {"type": "function_call", "id": item_id or f"fc_{uuid.uuid4().hex}", "status": status,
                "call_id": call.id, "name": name, "arguments": call.arguments, **extra}

    def response(self, status: str, output: list[dict[str, Any]], usage: Usage | None = None,
                 finish: str | None = None) -> dict[str, Any]:
        req = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
            "store": req.store, "temperature": req.temperature, "text": {"format": req.text_format},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "top_p": req.top_p,
            "truncation": req.truncation or "disabled",
            "usage": usage_json(usage) if usage is not None else None, "user": req.user,
            "metadata": req.metadata or {},
        }

    def finish(self, text: str, finish: str | None, usage: Usage, calls: list[ToolCall] = (), reasoning: str = "",
               output: list[dict[str, Any]] | None = None,
               logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The final response object (completed, or incomplete at max_output_tokens), stored if asked.

        `output`: the items a stream already sent (else a reasoning item if the model thought, a message with
        `text` if any or no calls, then the calls).
        """
        status = "incomplete" if finish == "length" else "completed"
        if output is None:
            output = ([reasoning_item(self.reasoning_id, reasoning, "completed", self.req.encrypted_reasoning)]
                      if reasoning else [])
            output += [self.item(text, status, logprobs=logprobs)] if text.strip() or not calls else []
            output += [self.call_item(c, "completed") for c in calls]
        final = self.response(status, output, usage, finish)
        if self.req.store:
            conversation = list(self.conversation)
            tool_calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                          for c in calls]
            if self.req.continue_final_message:  # the output continues the last assistant turn: one turn
                last = conversation.pop()
                conversation.append({"role": "assistant", "content": last["content"] + text})
            else:
                conversation.append({"role": "assistant", "content": text,
                                     **({"tool_calls": tool_calls} if tool_calls else {})})
            self.store.put(self.id, final, conversation, self.owner, self.images)
        return final


def custom_input(arguments: str) -> str:
    """A custom tool's free-text input out of the call's `{"input": ...}` arguments."""
    value = json.loads(arguments).get("input", "")
    return value if isinstance(value, str) else json.dumps(value)


def template_messages(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """instructions as the system message, then the conversation; developer is spelled system."""
    head = [{"role": "system", "content": req.instructions}] if req.instructions else []
    return head + [{**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in conversation]


def fit_context(conversation: list[dict[str, Any]], tokenize: Any, max_model_len: int) -> list[int]:
    """`truncation: "auto"`: the prompt ids of the conversation less its oldest turns, as few as leave the
    context room to generate. System and developer messages and the last user turn are kept; a dropped
    turn takes the tool results after it along. Nothing left to drop: the whole prompt (check_context's 400)."""
    turns = list(conversation)
    ids = tokenize(turns)
    while len(ids) >= max_model_len:
        last_user = max((i for i, m in enumerate(turns) if m["role"] == "user"), default=len(turns))
        first = next((i for i, m in enumerate(turns[:last_user]) if m["role"] not in ("system", "developer")), None)
        if first is None:
            return ids
        end = first + 1
        while end < last_user and turns[end]["role"] == "tool":
            end += 1
        del turns[first:end]
        ids = tokenize(turns)
    return ids


@bp.post("/v1/responses")
async def create_response() -> Any:
    req, engine = await engine_request(ResponsesRequest)
    req.check()
    refs = req.image_refs()
    decoded = await request_images(refs, engine, server().config.image_limits)
    store = responses_store()
    previous: list[dict[str, Any]] = []
    earlier: dict[str, ImageInput] = {}
    if req.previous_response_id is not None:
        entry = store.get(req.previous_response_id, caller_owner())
        if entry is None:
            raise _not_found(req.previous_response_id, "previous_response_id")
        previous = entry.conversation
        for digest, (raw, detail) in entry.images.items():   # stored encoded: decoded again, the same pixels
            earlier[digest] = await off_loop(decode, raw, "previous_response_id", server().config.image_limits, detail)
    images = PromptImages(refs, decoded, earlier)
    conversation = previous + conversation_of(req.input, images)
    cont = req.continue_final_message
    kwargs = template_kwargs(req.chat_template_kwargs, req.enable_thinking, (req.reasoning or {}).get("effort"),
                             "reasoning.effort")

    in_order: tuple[ImageInput, ...] = ()

    def tokenize(turns: list[dict[str, Any]]) -> list[int]:
        nonlocal in_order
        messages = template_messages(req, turns)
        text = render_prompt(engine.tokenizer, messages, req.tool_plan,
                             add_generation_prompt=not cont, continue_final_message=cont, **kwargs)
        check_chars(text, "input")
        text, in_order = expand(text, images, engine, "input", count_marks(m["content"] for m in messages))
        return engine.tokenizer.encode_chat(text)

    if req.truncation == "auto":
        ids = await off_loop(fit_context, conversation, tokenize, engine.max_model_len)
    else:
        ids = await off_loop(tokenize, conversation)
    check_context(len(ids), None, engine.max_model_len, "input")
    room = engine.max_model_len - len(ids)
    asked = default_max_tokens(req.max_output_tokens, len(ids), engine.max_model_len)
    max_tokens = room if asked is None else min(asked, room)
    params = req.sampling_params(max_tokens, req.engine_logprobs, engine.vocab_size)
    constraint, tool_format = await prepare_decoding(req.tool_plan, req.output_form, engine, params)
    token_text = TokenText(engine.tokenizer) if req.logprobs else None
    draft = ResponseDraft(f"resp_{uuid.uuid4().hex}", answering_model(engine), req, conversation, store, caller_owner(),
                          images.by_digest)
    set_response_id(draft.id)
    greq = GenerationRequest(draft.id, ids, params, priority=req.priority or 0, cache_prompt=bool(req.cache_prompt),
                             reasoning=True, constraint=constraint, images=in_order, tool_calls=tool_format is not None)
    events = await lifecycle.begin(engine, greq, bool(req.stream))
    if req.stream:
        return sse_response(drive(engine, draft.id, events, ResponseStream(draft, tool_format, token_text)))
    result = await collect(engine, greq, events)
    c = result.choices[0]  # calls are parsed out of the answer, never the reasoning
    reply = choice_reply(c, tool_format) if tool_format is not None else ParsedReply(c.text, [])
    logprobs = (lambda: chat_logprobs(c.logprobs or [], token_text)) if token_text is not None else (lambda: None)
    return await json_reply(lambda: draft.finish(reply.content, c.finish_reason, result.usage, reply.calls,
                                                 c.reasoning, logprobs=logprobs()))


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


class ResponseStream:
    """response.created, in_progress, then the output items as they come, each opened when its first text
    comes and closed by its done events: a reasoning item (its part and reasoning_text deltas) first when
    the model thinks, then a message (its part and text deltas) and calls (their arguments deltas) in the
    order generated; then completed/incomplete."""

    def __init__(self, draft: ResponseDraft, tool_format: str | None = None, token_text: TokenText | None = None):
        self._draft, self._token_text = draft, token_text
        self._logprobs: list[dict[str, Any]] = []   # the open message's (include: message.output_text.logprobs)
        self._pending: list[dict[str, Any]] = []    # the current event's, for its first text delta
        self._parser = PARSERS[tool_format]() if tool_format else None
        self._seq = 0
        self._text = ""                      # all the reply's text
        self._finish: str | None = None
        self._items: list[dict[str, Any]] = []   # output items done; the open one's output_index is len
        self._reasoning: str | None = None   # the open reasoning item's text
        self._message: str | None = None     # the open message item's text
        self._call: dict[str, Any] | None = None  # the open call item
        self._calls: list[ToolCall] = []

    def _frame(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse(body, kind)

    def _where(self, item_id: str | None = None) -> dict[str, Any]:
        """Where the open item's content is: its id (the message's unless given) and output_index."""
        return {"item_id": item_id or self._item_id(), "output_index": len(self._items), "content_index": 0}

    def _item_id(self) -> str:
        """The message item's id: the draft's for the first (as in a whole response), indexed for a later one."""
        first = all(item["type"] != "message" for item in self._items)
        return self._draft.item_id if first else f"{self._draft.item_id}_{len(self._items)}"

    def open(self) -> list[str]:
        pending = self._draft.response("in_progress", [])
        return [self._frame("response.created", response=pending),
                self._frame("response.in_progress", response=pending)]

    def _reasoning_delta(self, text: str) -> list[str]:
        """Reasoning goes to the leading reasoning item (none once the answer has begun)."""
        frames: list[str] = []
        if self._reasoning is None:
            if self._items or self._message is not None or self._call is not None:
                return []
            self._reasoning = ""
            frames += [self._frame("response.output_item.added", output_index=len(self._items),
                                   item=reasoning_item(self._draft.reasoning_id, None, "in_progress")),
                       self._frame("response.content_part.added", **self._where(self._draft.reasoning_id),
                                   part=reasoning_part(""))]
        self._reasoning += text
        return frames + [self._frame("response.reasoning_text.delta", **self._where(self._draft.reasoning_id),
                                     delta=text)]

    def _close_reasoning(self) -> list[str]:
        if self._reasoning is None:
            return []
        text, where = self._reasoning, self._where(self._draft.reasoning_id)
        item = reasoning_item(self._draft.reasoning_id, text, "completed", self._draft.req.encrypted_reasoning)
        frames = [self._frame("response.reasoning_text.done", **where, text=text),
                  self._frame("response.content_part.done", **where, part=reasoning_part(text)),
                  self._frame("response.output_item.done", output_index=len(self._items), item=item)]
        self._items.append(item)
        self._reasoning = None
        return frames

    def _open_message(self) -> list[str]:
        if self._message is not None:
            return []
        frames = self._close_reasoning()
        self._message = ""
        return frames + [self._frame("response.output_item.added", output_index=len(self._items),
                                     item=self._draft.item(None, "in_progress", self._item_id())),
                         self._frame("response.content_part.added", **self._where(), part=output_text(""))]

    def _text_delta(self, text: str) -> list[str]:
        frames = self._open_message()
        self._message += text
        self._text += text
        logprobs, self._pending = self._pending, []
        self._logprobs += logprobs
        return frames + [self._frame("response.output_text.delta", **self._where(), delta=text, logprobs=logprobs)]

    def _close_message(self, status: str) -> list[str]:
        if self._message is None:
            return []
        item = self._draft.item(self._message, status, self._item_id(), self._logprobs)
        frames = [self._frame("response.output_text.done", **self._where(), text=self._message,
                              logprobs=self._logprobs),
                  self._frame("response.content_part.done", **self._where(), part=item["content"][0]),
                  self._frame("response.output_item.done", output_index=len(self._items), item=item)]
        self._items.append(item)
        self._message, self._logprobs = None, []
        return frames

    def event(self, ev: EngineEvent) -> list[str]:
        if ev.finish_reason is not None:
            self._finish = ev.finish_reason
        frames = self._reasoning_delta(ev.reasoning_text) if ev.reasoning_text else []
        if self._token_text is not None and ev.logprobs and not ev.reasoning_text:
            self._pending = chat_logprobs(ev.logprobs, self._token_text)
        for e in event_answer(self._parser, ev):  # the answer only
            if isinstance(e, TextDelta):
                frames += self._text_delta(e.text)
            elif isinstance(e, CallStart):
                frames += self._close_reasoning() + self._close_message("completed")
                self._call = self._draft.call_item(ToolCall(e.id, e.name, "{}"), "in_progress")
                self._call["arguments" if self._call["type"] == "function_call" else "input"] = ""
                frames.append(self._frame("response.output_item.added", output_index=len(self._items),
                                          item=dict(self._call)))
            elif isinstance(e, ArgsDelta) and self._call is not None:
                if self._call["type"] == "function_call":
                    self._call["arguments"] += e.text
                    frames.append(self._frame("response.function_call_arguments.delta", item_id=self._call["id"],
                                              output_index=len(self._items), delta=e.text))
            elif isinstance(e, CallEnd) and self._call is not None:
                frames += self._end_call(e)
        return frames

    def _end_call(self, end: CallEnd) -> list[str]:
        """The call's done events: arguments (function) or its input, delta and done (custom), then the item."""
        call, where = self._call, {"item_id": self._call["id"], "output_index": len(self._items)}
        item = self._draft.call_item(ToolCall(call["call_id"], self._parser_name(call), end.arguments), "completed",
                                     call["id"]) if end.valid else {**call, "status": "incomplete"}
        if call["type"] == "function_call":
            frames = [self._frame("response.function_call_arguments.done", **where, arguments=item["arguments"])]
        else:
            frames = [self._frame("response.custom_tool_call_input.delta", **where, delta=item["input"]),
                      self._frame("response.custom_tool_call_input.done", **where, input=item["input"])]
        frames.append(self._frame("response.output_item.done", output_index=len(self._items), item=item))
        self._items.append(item)
        if end.valid:
            self._calls.append(ToolCall(call["call_id"], self._parser_name(call), end.arguments))
        self._call = None
        return frames

    @staticmethod
    def _parser_name(item: dict[str, Any]) -> str:
        """The name the model called (a namespaced tool's flattened name)."""
        ns = item.get("namespace")
        return f"{ns}{NAMESPACE_SEP}{item['name']}" if ns else item["name"]

    def close(self, usage: Usage | None) -> list[str]:
        status = "incomplete" if self._finish == "length" else "completed"
        answered = self._message is not None or any(item["type"] != "reasoning" for item in self._items)
        frames = [] if answered else self._open_message()  # a reply with no answer has an empty message
        frames += self._close_message(status)
        final = self._draft.finish(self._text, self._finish, usage or Usage(0, 0, 0), self._calls,
                                   output=self._items)
        return frames + [self._frame(f"response.{final['status']}", response=final)]

    def error(self, err: ImpError) -> list[str]:
        return [self._frame("error", code=err.code, message=err.message, param=err.param)]

    def ping(self) -> list[str]:
        return []
