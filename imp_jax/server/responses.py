"""OpenAI Responses: `POST /v1/responses` (whole or streamed), and `GET` / `DELETE /v1/responses/{id}`.

`store: true` (the default) keeps the finished response and its conversation in the app's
ResponsesStore, so a later request can continue it with `previous_response_id`.
"""
from __future__ import annotations

import dataclasses
import uuid
from typing import Any, Literal

from pydantic import field_validator
from quart import Blueprint, current_app, jsonify
from quart.blueprints import BlueprintSetupState

from imp_jax.errors import ImpError, InvalidRequestError, NotFoundError
from imp_jax.runtime.request import EngineEvent, GenerationRequest, Usage, check_context
from imp_jax.server import lifecycle, structured
from imp_jax.server.context import default_max_tokens, engine_request, set_response_id, state_of
from imp_jax.server.errors import not_supported
from imp_jax.server.generation import collect
from imp_jax.server.openai_common import OpenAISampling, now
from imp_jax.server.responses_store import STORE_KEY, ResponsesStore, StoreLimits
from imp_jax.server.streaming import drive, sse, sse_response
from imp_jax.server.validation import WireModel

bp = Blueprint("responses", __name__)
PART_JOIN = "\n"  # the text parts of one input message join with this (as vLLM)
MAX_METADATA = 16  # OpenAI's limits on metadata: keys, key length, value length
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512


class InputPart(WireModel):
    """A content part of an input message: `input_text` or `output_text` (anything else is a 400)."""

    type: str
    text: str

    @field_validator("type")
    @classmethod
    def _text_only(cls, v: str) -> str:
        if v not in ("input_text", "output_text"):
            raise ValueError(f"content part type {v!r} is not supported; only 'input_text' and 'output_text' are")
        return v


class InputItem(WireModel):
    """A message item; other item types (function calls, reasoning, references) are a 400 naming the item."""

    type: str = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: list[InputPart]

    @field_validator("type")
    @classmethod
    def _message_only(cls, v: str) -> str:
        if v != "message":
            raise ValueError(f"input item type {v!r} is not supported; only 'message' items are")
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _string_or_parts(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [{"type": "input_text", "text": v}]
        if not isinstance(v, list):
            raise ValueError("must be a string or a list of content parts")
        return v

    def message(self) -> dict[str, str]:
        """The item as one stored conversation message: role and text."""
        return {"role": self.role, "content": PART_JOIN.join(p.text for p in self.content if p.text)}


class TextConfig(WireModel):
    format: dict[str, Any] | None = None


class ResponsesRequest(OpenAISampling):
    """`POST /v1/responses`: OpenAI's fields plus the shared extensions (top_k, min_p, penalties, ...)."""

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
    reasoning: dict[str, Any] | None = None
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
        return v

    def check(self) -> None:
        self.check_common()
        if not self.input or not any(item.message()["content"] for item in self.input):
            raise InvalidRequestError("'input' must hold some text", param="input")
        if "max_tokens" in self.model_fields_set:
            raise InvalidRequestError("'max_tokens' is not a Responses field; use 'max_output_tokens'",
                                      param="max_tokens")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise InvalidRequestError("'max_output_tokens' must be >= 1", param="max_output_tokens")
        if self.n != 1:
            raise InvalidRequestError("'n' must be 1: a response holds one answer", param="n")
        if self.tools:
            raise not_supported("'tools' are not supported yet", param="tools")
        if self.background:
            raise not_supported("'background' responses are not supported", param="background")
        if self.top_logprobs:
            raise not_supported("'top_logprobs' is not supported on /v1/responses yet", param="top_logprobs")
        if self.truncation not in (None, "auto", "disabled"):
            raise InvalidRequestError("'truncation' must be 'auto' or 'disabled'", param="truncation")
        self._check_metadata()
        if self.continue_final_message:
            last = self.input[-1]
            if last.role != "assistant" or not last.message()["content"]:
                raise InvalidRequestError("'continue_final_message' needs a final assistant message with text",
                                          param="continue_final_message")

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
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclasses.dataclass
class ResponseDraft:
    """A response in the making: what its object echoes from the request, and where it is kept when done."""

    id: str
    model: str
    req: ResponsesRequest
    conversation: list[dict[str, str]]  # the previous conversation plus this input
    store: ResponsesStore
    created_at: int = dataclasses.field(default_factory=now)
    item_id: str = dataclasses.field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")

    def item(self, text: str | None, status: str) -> dict[str, Any]:
        """The assistant message output item; `text` None: no content part yet."""
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant",
                "content": [] if text is None else [output_text(text)]}

    def response(self, status: str, output: list[dict[str, Any]], usage: Usage | None = None,
                 finish: str | None = None) -> dict[str, Any]:
        req = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": req.store, "temperature": req.temperature, "text": {"format": req.text_format},
            "tool_choice": "auto", "tools": [], "top_p": req.top_p, "truncation": req.truncation or "disabled",
            "usage": usage_json(usage) if usage is not None else None, "user": req.user,
            "metadata": req.metadata or {},
        }

    def finish(self, text: str, finish: str | None, usage: Usage) -> dict[str, Any]:
        """The final response object (completed, or incomplete at max_output_tokens), stored if asked."""
        status = "incomplete" if finish == "length" else "completed"
        final = self.response(status, [self.item(text, status)], usage, finish)
        if self.req.store:
            conversation = list(self.conversation)
            if self.req.continue_final_message:  # the output continues the last assistant turn: one turn
                last = conversation.pop()
                conversation.append({"role": "assistant", "content": last["content"] + text})
            else:
                conversation.append({"role": "assistant", "content": text})
            self.store.put(self.id, final, conversation)
        return final


def template_messages(req: ResponsesRequest, conversation: list[dict[str, str]]) -> list[dict[str, str]]:
    """instructions as the system message, then the conversation; developer is spelled system."""
    head = [{"role": "system", "content": req.instructions}] if req.instructions else []
    return head + [{"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]}
                   for m in conversation]


@bp.post("/v1/responses")
async def create_response() -> Any:
    req, engine = await engine_request(ResponsesRequest)
    req.check()
    store = responses_store()
    previous: list[dict[str, str]] = []
    if req.previous_response_id is not None:
        entry = store.get(req.previous_response_id)
        if entry is None:
            raise _not_found(req.previous_response_id, "previous_response_id")
        previous = entry.conversation
    conversation = previous + [item.message() for item in req.input]
    cont = req.continue_final_message
    text = engine.tokenizer.apply_chat_template(template_messages(req, conversation), add_generation_prompt=not cont,
                                                continue_final_message=cont)
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    check_context(len(ids), None, engine.max_model_len, "input")
    room = engine.max_model_len - len(ids)
    asked = default_max_tokens(req.max_output_tokens, len(ids), engine.max_model_len)
    max_tokens = room if asked is None else min(asked, room)
    params = req.sampling_params(max_tokens, None, engine.vocab_size)
    constraint = await structured.constraint(structured.responses_format(req.text_format), engine, params)
    draft = ResponseDraft(f"resp_{uuid.uuid4().hex}", engine.served_name, req, conversation, store)
    set_response_id(draft.id)
    greq = GenerationRequest(draft.id, ids, params, priority=req.priority or 0, cache_prompt=bool(req.cache_prompt),
                             constraint=constraint)
    events = await lifecycle.begin(engine, greq, bool(req.stream))
    if req.stream:
        return sse_response(drive(engine, draft.id, events, ResponseStream(draft)))
    result = await collect(engine, greq, events)
    c = result.choices[0]
    return jsonify(draft.finish(c.text, c.finish_reason, result.usage))


def _not_found(response_id: str, param: str) -> NotFoundError:
    return NotFoundError(f"no stored response with id '{response_id}' (never stored, deleted, or expired)",
                         code="response_not_found", param=param)


@bp.get("/v1/responses/<response_id>")
async def retrieve_response(response_id: str) -> Any:
    entry = responses_store().get(response_id)
    if entry is None:
        raise _not_found(response_id, "response_id")
    return jsonify(entry.response)


@bp.delete("/v1/responses/<response_id>")
async def delete_response(response_id: str) -> Any:
    if not responses_store().delete(response_id):
        raise _not_found(response_id, "response_id")
    return jsonify({"id": response_id, "object": "response", "deleted": True})


class ResponseStream:
    """response.created, in_progress, the item and its part, text deltas, the done events, completed/incomplete."""

    def __init__(self, draft: ResponseDraft):
        self._draft = draft
        self._seq = 0
        self._text = ""
        self._finish: str | None = None

    def _frame(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse(body, kind)

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._draft.item_id, "output_index": 0, "content_index": 0}

    def open(self) -> list[str]:
        pending = self._draft.response("in_progress", [])
        return [self._frame("response.created", response=pending),
                self._frame("response.in_progress", response=pending),
                self._frame("response.output_item.added", output_index=0, item=self._draft.item(None, "in_progress")),
                self._frame("response.content_part.added", **self._where(), part=output_text(""))]

    def event(self, ev: EngineEvent) -> list[str]:
        if ev.finish_reason is not None:
            self._finish = ev.finish_reason
        if not ev.text:
            return []
        self._text += ev.text
        return [self._frame("response.output_text.delta", **self._where(), delta=ev.text, logprobs=[])]

    def close(self, usage: Usage | None) -> list[str]:
        final = self._draft.finish(self._text, self._finish, usage or Usage(0, 0, 0))
        item = final["output"][0]
        return [self._frame("response.output_text.done", **self._where(), text=self._text, logprobs=[]),
                self._frame("response.content_part.done", **self._where(), part=item["content"][0]),
                self._frame("response.output_item.done", output_index=0, item=item),
                self._frame(f"response.{final['status']}", response=final)]

    def error(self, err: ImpError) -> list[str]:
        return [self._frame("error", code=err.code, message=err.message, param=err.param)]

    def ping(self) -> list[str]:
        return []
