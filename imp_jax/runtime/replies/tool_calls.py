"""Tool calls out of generated text, whole or while it streams, in the three conventions models use.

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, text around it (Hermes, Qwen,
  and the generic preamble of templates with no tool support);
- llama3_json: the reply *is* the call(s): `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several joined by `;`;
- mistral: text, then `[TOOL_CALLS]` and a JSON array of calls, or `[TOOL_CALLS]name[ARGS]{...}`;
- harmony (gpt-oss): a message to `functions.NAME`, as the engine's harmony tracker writes it into the
  answer: `<|start|>HEADER<|message|>{...}`, then `<|end|>` or the end of the reply. The engine runs this
  parser itself when tools are offered (harmony.py), so its events carry the calls as values.

One incremental parser per format; the whole-text parse is the same parser fed everything at once,
so streamed and whole replies agree. A call is announced (CallStart) as soon as its name is known
and its arguments stream as they arrive (ArgsDelta); the call's markup never appears as text. A call
that turns out malformed ends with CallEnd(valid=False): the whole-text parse keeps its markup as text.
"""
from __future__ import annotations

import re

from imp_jax.runtime.replies.call_parser import ToolCallParser, emit_text_until
from imp_jax.runtime.replies.calls import CallEnd, ParsedReply, ParseEvent, TextDelta, collect_reply


class HermesParser(ToolCallParser):
    """`<tool_call>{...}</tool_call>` anywhere in the text; the text around calls is content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def _run(self, out: list[ParseEvent], final: bool) -> None:
        while self._buf:
            call = self._call
            if call is None:
                self._buf, found = emit_text_until(out, self._buf, self.OPEN, final)
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
                self._buf, found = emit_text_until(out, self._buf, self.OPEN, final)
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
                self._buf, found = emit_text_until(out, self._buf, self.OPEN, final)
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
