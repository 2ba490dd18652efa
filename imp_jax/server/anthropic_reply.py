"""The Messages reply: the `message` object with Anthropic's content blocks, stop reasons and usage, whole or
as its SSE event sequence (MessageStream), and Anthropic's error envelope mid-stream."""
from __future__ import annotations

import json
from typing import Any

from imp_jax.errors import ImpError
from imp_jax.runtime.request import EngineEvent, Usage
from imp_jax.server.errors import anthropic_error_body
from imp_jax.server.reasoning import Thinking, signature
from imp_jax.server.streaming import sse
from imp_jax.runtime.replies.calls import ArgsDelta, CallEnd, CallStart, TextDelta, ToolCall
from imp_jax.runtime.replies.tool_calls import PARSERS
from imp_jax.server.tools import event_answer

TEXT_BLOCK = {"type": "text", "text": ""}                               # streamed blocks as they start
THINKING_BLOCK = {"type": "thinking", "thinking": "", "signature": ""}


def usage_json(usage: Usage) -> dict[str, Any]:
    """Anthropic usage: input_tokens excludes the prefix-cache hit, which is cache_read_input_tokens; the
    imp_spec_* counters (speculative decoding) are lifted to the top level."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": usage.cached_tokens, **(usage.spec or {})}


def stop_reason(finish: str | None, matched: str | int | None, clamped: bool,
                called: bool = False) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for an engine finish; `clamped`: max_tokens was cut to the context left;
    `called`: the reply made tool calls."""
    if finish == "length":
        return ("model_context_window_exceeded" if clamped else "max_tokens"), None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return ("tool_use" if called else "end_turn"), None


def tool_use_id(call_id: str) -> str:
    """A parsed call's id in Anthropic's spelling."""
    return "toolu_" + call_id.removeprefix("call_")


def message_json(mid: str, model: str, text: str | None, reason: tuple[str | None, str | None],
                 usage: dict[str, int], calls: list[ToolCall] = (),
                 thinking: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `message` object; `text` None (a stream's message_start) has no content yet. A thinking block first;
    with tool calls, a text block only if there is text, then one tool_use block per call."""
    content = [thinking] if thinking else []
    content += [{"type": "text", "text": text}] if text is not None and (text.strip() or not calls) else []
    content += [{"type": "tool_use", "id": tool_use_id(c.id), "name": c.name, "input": json.loads(c.arguments)}
                for c in calls]
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason[0], "stop_sequence": reason[1], "usage": usage}


class MessageStream:
    """message_start, ping, content blocks (start, deltas, stop), message_delta, message_stop.

    Plain text: one text block, opened at once. Otherwise blocks open as the reply needs them, in the
    order generated: a thinking block first (opted in, when the model thinks: thinking_delta...,
    signature_delta), then text blocks (text_delta) and, with tools, tool_use blocks (input_json_delta).
    """

    def __init__(self, mid: str, model: str, prompt_tokens: int, clamped: bool, tool_format: str | None = None,
                 thinking: Thinking | None = None):
        self._mid, self._model, self._prompt_tokens, self._clamped = mid, model, prompt_tokens, clamped
        self._finish: str | None = None
        self._matched: str | int | None = None
        self._parser = PARSERS[tool_format]() if tool_format else None
        self._thinking = thinking
        self._reasoning = ""                # the thinking block's text, for its signature
        self._started: list[str] = []       # the types of the blocks started; the last one's index is len - 1
        self._open: str | None = None       # the type of the block open now

    def open(self) -> list[str]:
        start_usage = {"input_tokens": self._prompt_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                       "cache_read_input_tokens": 0}  # the cache split is known at the end: message_delta
        message = message_json(self._mid, self._model, None, (None, None), start_usage)
        frames = [sse({"type": "message_start", "message": message}, "message_start"), *self.ping()]
        lazy = self._parser is not None or self._thinking is not None
        return frames if lazy else frames + self._start(TEXT_BLOCK)

    def _start(self, block: dict[str, Any]) -> list[str]:
        frames = self._stop()
        self._open = block["type"]
        self._started.append(block["type"])
        return frames + [sse({"type": "content_block_start", "index": self._index, "content_block": block},
                             "content_block_start")]

    def _stop(self) -> list[str]:
        if self._open is None:
            return []
        frames = [self._delta({"type": "signature_delta", "signature": signature(self._reasoning)})
                  ] if self._open == "thinking" else []
        self._open = None
        return frames + [sse({"type": "content_block_stop", "index": self._index}, "content_block_stop")]

    @property
    def _index(self) -> int:
        return len(self._started) - 1

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse({"type": "content_block_delta", "index": self._index, "delta": delta}, "content_block_delta")

    def _think(self, text: str) -> list[str]:
        """Reasoning goes to the leading thinking block (opted in only; none once the answer has begun)."""
        if self._thinking is None or (self._open != "thinking" and self._started):
            return []
        frames = [] if self._open == "thinking" else self._start(THINKING_BLOCK)
        self._reasoning += text
        if self._thinking.display != "omitted":
            frames.append(self._delta({"type": "thinking_delta", "thinking": text}))
        return frames

    def event(self, ev: EngineEvent) -> list[str]:
        if ev.finish_reason is not None:
            self._finish, self._matched = ev.finish_reason, ev.stop_reason
        frames = self._think(ev.reasoning_text) if ev.reasoning_text else []
        for e in event_answer(self._parser, ev):  # the answer only
            if isinstance(e, TextDelta):
                if self._open != "text":
                    frames += self._start(TEXT_BLOCK)
                frames.append(self._delta({"type": "text_delta", "text": e.text}))
            elif isinstance(e, CallStart):
                frames += self._start({"type": "tool_use", "id": tool_use_id(e.id), "name": e.name, "input": {}})
            elif isinstance(e, ArgsDelta):
                frames.append(self._delta({"type": "input_json_delta", "partial_json": e.text}))
            elif isinstance(e, CallEnd):
                frames += self._stop()
        return frames

    def close(self, usage: Usage | None) -> list[str]:
        reason, matched = stop_reason(self._finish, self._matched, self._clamped, "tool_use" in self._started)
        delta_usage = usage_json(usage) if usage is not None else {"output_tokens": 0}
        answered = any(kind != "thinking" for kind in self._started)
        return [*(self._stop() if answered else self._start(TEXT_BLOCK) + self._stop()),
                sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": matched},
                     "usage": delta_usage}, "message_delta"),
                sse({"type": "message_stop"}, "message_stop")]

    def error(self, err: ImpError) -> list[str]:
        return [sse(anthropic_error_body(err, self._mid), "error")]

    def ping(self) -> list[str]:
        return [sse({"type": "ping"}, "ping")]
