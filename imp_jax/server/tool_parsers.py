"""Tool calls out of generated text, whole or while it streams, in the three conventions models use.

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, text around it (Hermes, Qwen,
  and the generic preamble of templates with no tool support);
- llama3_json: the reply *is* the call(s): `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several joined by `;`;
- mistral: text, then `[TOOL_CALLS]` and a JSON array of calls, or `[TOOL_CALLS]name[ARGS]{...}`;
- harmony (gpt-oss): a message to `functions.NAME`, as the engine's harmony tracker writes it into the
  answer: `<|start|>HEADER<|message|>{...}`, then `<|end|>` or the end of the reply.

One incremental parser per format; the whole-text parse is the same parser fed everything at once,
so streamed and whole replies agree. A call is announced (CallStart) as soon as its name is known
and its arguments stream as they arrive (ArgsDelta); the call's markup never appears as text. A call
that turns out malformed ends with CallEnd(valid=False): the whole-text parse keeps its markup as text.
"""
from __future__ import annotations

import dataclasses
import json
import re
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


class ToolCallParser:
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
        return self._spaced(_merge(out), final=False)

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
        return _merge(out)

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
        return self._spaced(_merge(out), final=True)

    def _run(self, out: list[ParseEvent], final: bool) -> None:
        raise NotImplementedError

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


def _merge(events: list[ParseEvent]) -> list[ParseEvent]:
    """Join neighbouring text and argument deltas; drop empty text."""
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


def _emit_text_until(out: list[ParseEvent], buf: str, tag: str, final: bool) -> tuple[str, bool]:
    """Emit `buf` as text up to `tag`; returns (what follows the tag, found). Holds back a partial tag."""
    at = buf.find(tag)
    if at >= 0:
        out.append(TextDelta(buf[:at]))
        return buf[at + len(tag):], True
    keep = 0 if final else _partial_suffix(buf, tag)
    out.append(TextDelta(buf[:len(buf) - keep]))
    return buf[len(buf) - keep:], False


class HermesParser(ToolCallParser):
    """`<tool_call>{...}</tool_call>` anywhere in the text; the text around calls is content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def _run(self, out: list[ParseEvent], final: bool) -> None:
        while self._buf:
            call = self._call
            if call is None:
                self._buf, found = _emit_text_until(out, self._buf, self.OPEN, final)
                if not found:
                    return
                self._open_call(out, self.OPEN)
            elif call.end is not None:  # the object closed: its closing tag should follow
                rest = self._buf.lstrip()
                if rest.startswith(self.CLOSE) or final and self.CLOSE.startswith(rest):
                    tail = self._buf[:len(self._buf) - len(rest) + min(len(rest), len(self.CLOSE))]
                    self._buf = self._buf[len(tail):]
                    self._end_call(out, tail)  # (the text may end inside the closing tag)
                elif rest and not self.CLOSE.startswith(rest) or final:
                    self._end_call(out)  # no closing tag: the call ends with its object
                else:
                    return
            elif not call.raw and not self._buf.startswith("{"):
                rest = self._buf.lstrip()
                self._markup += self._buf[:len(self._buf) - len(rest)]
                self._buf = rest
                if rest and not rest.startswith("{"):  # no JSON after the tag: it was text
                    call.end = CallEnd(call.index, "", False, "")
                    self._end_call(out)
            elif not self._feed_call(out):
                return


class Llama3JsonParser(ToolCallParser):
    """A reply starting with `{` (or `<|python_tag|>`) is calls joined by `;`; any other reply is text."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._mode = "start"  # start: undecided; calls: between calls; text: text to the end

    def _run(self, out: list[ParseEvent], final: bool) -> None:
        while self._buf:
            if self._mode == "text":
                out.append(TextDelta(self._buf))
                self._buf = ""
            elif self._call is not None:
                if not self._feed_call(out):
                    return
                self._end_call(out)
            else:
                rest = self._buf.lstrip(" \t\r\n;" if self._mode == "calls" else " \t\r\n")
                lead = self._buf[:len(self._buf) - len(rest)]
                if rest.startswith(self.TAG):
                    rest = rest[len(self.TAG):].lstrip()
                    lead = self._buf[:len(self._buf) - len(rest)]
                elif rest and self.TAG.startswith(rest) and not final:
                    return
                if rest.startswith("{"):
                    self._mode, self._buf = "calls", rest
                    self._open_call(out, lead)
                elif rest or final:
                    self._mode = "text"
                    if self._count:  # text after the calls: the separators before it are not text
                        self._buf = rest
                else:
                    return


class MistralParser(ToolCallParser):
    """Text, then `[TOOL_CALLS]` and a JSON array of calls (v3), or `name[ARGS]{...}` pairs (v11)."""

    OPEN, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self) -> None:
        super().__init__()
        self._mode = "text"  # text | tag (after [TOOL_CALLS]) | array (inside [...]) | name (v11)

    def _run(self, out: list[ParseEvent], final: bool) -> None:
        while self._buf:
            if self._call is not None:
                if not self._feed_call(out):
                    return
                self._end_call(out)
                if self._mode == "name":
                    self._mode = "text"
            elif self._mode == "text":
                self._buf, found = _emit_text_until(out, self._buf, self.OPEN, final)
                if not found:
                    return
                self._mode = "tag"
            elif self._mode == "tag":
                self._buf = self._buf.lstrip()
                if self._buf.startswith("["):
                    self._buf, self._mode = self._buf[1:], "array"
                elif self._buf:
                    self._mode = "name"
            elif self._mode == "array":
                self._buf = self._buf.lstrip(" \t\r\n,")
                if self._buf.startswith("]"):
                    self._buf, self._mode = self._buf[1:], "text"
                elif self._buf.startswith("{"):
                    self._open_call(out, "")
                elif self._buf:
                    self._mode = "text"
            else:
                name, found, args = self._buf.partition(self.ARGS)
                if not found:
                    if final:
                        self._mode = "text"
                    return
                self._buf = args.lstrip()
                self._open_call(out, "", name.strip(), bare=True)


class HarmonyParser(ToolCallParser):
    """gpt-oss's calls as the engine's harmony tracker writes them into the answer (runtime/replies/harmony.py):
    `<|start|>HEADER<|message|>ARGS`, closed by `<|end|>` (or the reply's end). A header addressed to
    `functions.NAME` is a call of NAME; any other recipient (a built-in tool) keeps its message as text."""

    OPEN, MESSAGE, CLOSE = "<|start|>", "<|message|>", "<|end|>"
    _RECIPIENT = re.compile(r"\bto=functions\.([^\s<]+)")

    def __init__(self) -> None:
        super().__init__()
        self._header: str | None = None   # the header being read (after <|start|>), None outside one

    def _run(self, out: list[ParseEvent], final: bool) -> None:
        while self._buf or final and self._header is not None:
            call = self._call
            if call is None and self._header is None:
                self._buf, found = _emit_text_until(out, self._buf, self.OPEN, final)
                if not found:
                    return
                self._header = ""
            elif call is None:
                self._header += self._buf
                self._buf, at = "", self._header.find(self.MESSAGE)
                if at < 0:
                    if final:   # a header never finished: text
                        out.append(TextDelta(self.OPEN + self._header))
                        self._header = None
                    return
                header, self._buf = self._header[:at], self._header[at + len(self.MESSAGE):]
                self._header, markup = None, self.OPEN + header + self.MESSAGE
                m = self._RECIPIENT.search(header)
                if m is None:
                    out.append(TextDelta(markup))
                else:
                    self._open_call(out, markup, m.group(1), bare=True)
            elif call.end is not None:   # the arguments closed: <|end|> may follow
                rest = self._buf.lstrip()
                if rest.startswith(self.CLOSE):
                    tail = self._buf[:len(self._buf) - len(rest) + len(self.CLOSE)]
                    self._buf = self._buf[len(tail):]
                    self._end_call(out, tail)
                elif rest and not self.CLOSE.startswith(rest) or final:
                    self._end_call(out)
                else:
                    return
            elif not call.raw and not self._buf.startswith("{"):
                rest = self._buf.lstrip()
                self._markup += self._buf[:len(self._buf) - len(rest)]
                self._buf = rest
                if rest and not rest.startswith("{"):   # arguments that are no JSON object: not a valid call
                    self._text_call(out)
            elif not self._feed_call(out):
                return

    def _text_call(self, out: list[ParseEvent]) -> None:
        """Arguments that are not an object: the call is invalid, its message kept as text to its end."""
        call = self._call
        assert call is not None
        at = self._buf.find(self.CLOSE)
        body = self._buf if at < 0 else self._buf[:at + len(self.CLOSE)]
        self._buf = self._buf[len(body):]
        call.end = CallEnd(call.index, "", False, "")
        self._end_call(out, body)


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser,
                                            "mistral": MistralParser, "harmony": HarmonyParser}


def answer_events(parser: ToolCallParser | None, text: str, last: bool) -> list[ParseEvent]:
    """A stream's next piece of answer text as parse events: with a parser, calls parsed out (what it holds
    back flushed when `last`); without one, plain text."""
    if parser is None:
        return [TextDelta(text)] if text else []
    return parser.feed(text) + (parser.finish() if last else [])


def parse_reply(text: str, fmt: str) -> ParsedReply:
    """The whole text's content and valid calls (a malformed call stays in the content as generated)."""
    parser = PARSERS[fmt]()
    return collect_reply(parser.feed(text) + parser.finish())


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
