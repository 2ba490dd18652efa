"""The Responses reply: the response object and its output items (ResponseDraft, which also stores a finished
response for `previous_response_id`), whole or as its SSE event sequence (ResponseStream)."""
from __future__ import annotations

import dataclasses
import json
import uuid
from typing import TYPE_CHECKING, Any

from imp_jax.errors import ImpError
from imp_jax.runtime.request import EngineEvent, ImageInput, Usage
from imp_jax.server.logprobs import TokenText, chat_logprobs
from imp_jax.server.openai_common import now
from imp_jax.server.reasoning import reasoning_item, reasoning_part
from imp_jax.server.responses_store import ResponsesStore
from imp_jax.server.streaming import sse
from imp_jax.runtime.replies.calls import ArgsDelta, CallEnd, CallStart, TextDelta, ToolCall
from imp_jax.runtime.replies.tool_calls import PARSERS
from imp_jax.server.tools import event_answer
from imp_jax.server.tools import NAMESPACE_SEP

if TYPE_CHECKING:
    from imp_jax.server.responses import ResponsesRequest


def usage_json(usage: Usage) -> dict[str, Any]:
    """The Responses usage object. `cache_write_tokens` is 0: prompts enter the prefix cache without a write
    charge. Every field the SDK's `ResponseUsage` requires is here: a missing one fails its strict validation,
    and the openai client then builds stream events by a path that races between threads."""
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
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
