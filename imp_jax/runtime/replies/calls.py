"""A reply's tool calls as values: what the parsers (tool_calls.py) make of the reply's text.

While a reply streams, a call is announced (CallStart) as soon as its name is known, its arguments follow
(ArgsDelta), and CallEnd closes it: `valid` says whether it parsed, `markup` is its text as generated
(kept as content when it did not). TextDelta is the content around calls.
"""
from __future__ import annotations

import dataclasses
import uuid
from typing import Union


@dataclasses.dataclass
class TextDelta:
    text: str


@dataclasses.dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclasses.dataclass
class ArgsDelta:
    index: int
    text: str


@dataclasses.dataclass
class CallEnd:
    index: int
    arguments: str   # the whole arguments JSON text: the ArgsDelta texts joined
    valid: bool      # the call parsed: a name and an object of arguments
    markup: str      # the call's text as generated (kept as content when it is not valid)


ParseEvent = Union[TextDelta, CallStart, ArgsDelta, CallEnd]


@dataclasses.dataclass
class ToolCall:
    id: str
    name: str
    arguments: str   # JSON text of an object


@dataclasses.dataclass
class ParsedReply:
    content: str
    calls: list[ToolCall]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def merge_parts(events: list[ParseEvent]) -> list[ParseEvent]:
    """Join neighbouring text and argument deltas (new objects: the given ones are left as they are); drop empty
    text."""
    merged: list[ParseEvent] = []
    for ev in events:
        last = merged[-1] if merged else None
        if isinstance(ev, TextDelta) and not ev.text:
            continue
        if isinstance(ev, TextDelta) and isinstance(last, TextDelta):
            last.text += ev.text
        elif isinstance(ev, ArgsDelta) and isinstance(last, ArgsDelta) and last.index == ev.index:
            last.text += ev.text
        else:
            merged.append(dataclasses.replace(ev))
    return merged


def collect_reply(events: list[ParseEvent]) -> ParsedReply:
    """Fold parse events into content and the valid calls."""
    content, calls = "", []
    starts: dict[int, CallStart] = {}
    for ev in events:
        if isinstance(ev, TextDelta):
            content += ev.text
        elif isinstance(ev, CallStart):
            starts[ev.index] = ev
        elif isinstance(ev, CallEnd):
            start = starts.get(ev.index)
            if ev.valid and start is not None:
                calls.append(ToolCall(start.id, start.name, ev.arguments))
            else:
                content += ev.markup
    return ParsedReply(content, calls)
