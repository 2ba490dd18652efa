"""The incremental tool-call parser's machinery (the formats are tool_calls.py's): the text held back until it
is decided, one call's JSON object read a character at a time, and the events folded as they go out."""
from __future__ import annotations

import abc
import dataclasses
import json
import re

from imp_jax.runtime.replies.calls import ArgsDelta, CallEnd, CallStart, ParseEvent, TextDelta, merge_parts, new_call_id

# {"name": "...", "arguments": — once this much of a call is out, its name is known and its arguments follow
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:')


class _JsonDepth:
    """Nesting depth of JSON text read one character at a time (aware of strings and escapes)."""

    def __init__(self) -> None:
        self.depth, self.in_string, self._escape = 0, False, False

    def step(self, ch: str) -> None:
        if self.in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1


class _Call:
    """One call being read: a `{"name", "arguments"}` object, or (`bare`, name known) an arguments object."""

    def __init__(self, index: int, name: str | None = None, bare: bool = False):
        self.index, self.name, self.bare = index, name, bare
        self.id = new_call_id()
        self.raw = ""           # the object's text
        self.args = ""          # arguments text emitted so far
        self._ws = ""           # whitespace held back inside the arguments (dropped if they end there)
        self._json = _JsonDepth()
        self._in_args = bare
        self._args_done = False
        self.end: CallEnd | None = None  # set when the object closed

    def start(self) -> list[ParseEvent]:
        return [CallStart(self.index, self.id, self.name)] if self.name is not None else []

    def feed(self, ch: str) -> list[ParseEvent]:
        """Read one character of the object (the first is its `{`); `end` is set on its last."""
        depth, in_string = self._json.depth, self._json.in_string
        self.raw += ch
        self._json.step(ch)
        out: list[ParseEvent] = []
        if self.bare:
            out.append(ArgsDelta(self.index, ch))
            self.args += ch
        elif self.name is None:
            if depth == 1 and not in_string and ch == ":":
                m = _HEAD.fullmatch(self.raw)
                if m:
                    self.name, self._in_args = _unescape(m.group(1)), True
                    out.extend(self.start())
        elif self._in_args and not self._args_done:
            if depth == 1 and not in_string and ch in ",}":
                self._args_done = True
            elif depth == 1 and not in_string and ch.isspace():
                if self.args:
                    self._ws += ch
            else:
                out.append(ArgsDelta(self.index, self._ws + ch))
                self.args += self._ws + ch
                self._ws = ""
        if self._json.depth == 0 and not self._json.in_string:
            out.extend(self._close())
        return out

    def _close(self) -> list[ParseEvent]:
        """The object closed: check it; a call whose head never matched (keys reordered) is announced now."""
        if self.bare:
            self.end = CallEnd(self.index, self.args, _is_object(self.args), "")
            return []
        try:
            obj = json.loads(self.raw)
        except ValueError:
            obj = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            self.end = CallEnd(self.index, self.args, False, "")
            return []
        args = obj.get("arguments", obj.get("parameters", {}))
        out: list[ParseEvent] = []
        if self.name is None:
            self.name = obj["name"]
            self.args = json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else ""
            out = [*self.start(), ArgsDelta(self.index, self.args)]
        self.end = CallEnd(self.index, self.args, isinstance(args, dict) and _is_object(self.args), "")
        return out


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _unescape(json_string_body: str) -> str:
    try:
        return json.loads(f'"{json_string_body}"')
    except ValueError:
        return json_string_body


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (text to hold back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolCallParser(abc.ABC):
    """Base of the incremental parsers: feed() text as it comes, finish() at its end; both return events."""

    def __init__(self) -> None:
        self._buf = ""                 # text not decided on yet
        self._call: _Call | None = None
        self._markup = ""              # the open call's text so far, tags included
        self._count = 0
        self._ws = ""                  # trailing whitespace of the text so far: dropped if a call follows
        self._called = False           # a call has started

    def feed(self, text: str) -> list[ParseEvent]:
        out: list[ParseEvent] = []
        self._buf += text
        self._run(out, final=False)
        return self._spaced(merge_parts(out), final=False)

    def _spaced(self, events: list[ParseEvent], final: bool) -> list[ParseEvent]:
        """Whitespace right before a call, or at the end after calls, is not content (Hermes puts newlines
        around and between calls): trailing whitespace is held until more text follows, dropped if a call does."""
        out: list[ParseEvent] = []
        for ev in events:
            if isinstance(ev, TextDelta):
                text = self._ws + ev.text
                body = text.rstrip()
                self._ws = text[len(body):]
                if body:
                    out.append(TextDelta(body))
            else:
                if isinstance(ev, CallStart):
                    self._ws, self._called = "", True
                out.append(ev)
        if final:
            if self._ws and not self._called:
                out.append(TextDelta(self._ws))
            self._ws = ""
        return merge_parts(out)

    def finish(self) -> list[ParseEvent]:
        out: list[ParseEvent] = []
        self._run(out, final=True)
        if self._call is not None:  # the text ended inside a call
            if self._call.end is None:
                self._call.end = CallEnd(self._call.index, self._call.args, False, "")
            self._end_call(out, self._buf)
            self._buf = ""
        out.append(TextDelta(self._buf))
        self._buf = ""
        return self._spaced(merge_parts(out), final=True)

    @abc.abstractmethod
    def _run(self, out: list[ParseEvent], final: bool) -> None:
        """Consume the buffered text into `out`, keeping back what may still be markup (all of it when `final`)."""

    def _open_call(self, out: list[ParseEvent], markup: str, name: str | None = None, bare: bool = False) -> None:
        self._call = _Call(self._count, name, bare)
        self._count += 1
        self._markup = markup
        out.extend(self._call.start())

    def _feed_call(self, out: list[ParseEvent]) -> bool:
        """Move buffered characters into the open call; True once its object closed."""
        call = self._call
        assert call is not None
        i = 0
        while i < len(self._buf) and call.end is None:
            out.extend(call.feed(self._buf[i]))
            i += 1
        self._markup += self._buf[:i]
        self._buf = self._buf[i:]
        return call.end is not None

    def _end_call(self, out: list[ParseEvent], tail: str = "") -> None:
        """Emit the closed call's end with its whole markup; a call never announced is plain text."""
        call = self._call
        assert call is not None and call.end is not None
        markup = self._markup + tail
        if call.name is None:
            out.append(TextDelta(markup))
        else:
            out.append(dataclasses.replace(call.end, markup=markup))
        self._call, self._markup = None, ""


def emit_text_until(out: list[ParseEvent], buf: str, tag: str, final: bool) -> tuple[str, bool]:
    """Emit `buf` as text up to `tag`; returns (what follows the tag, found). Holds back a partial tag."""
    at = buf.find(tag)
    if at >= 0:
        out.append(TextDelta(buf[:at]))
        return buf[at + len(tag):], True
    keep = 0 if final else _partial_suffix(buf, tag)
    out.append(TextDelta(buf[:len(buf) - keep]))
    return buf[len(buf) - keep:], False
