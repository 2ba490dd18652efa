"""Harmony (gpt-oss): the reply is a sequence of messages, not one think block and an answer.

A message is `<|start|>ROLE[ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>
CONTENT<|end|>`; the reply's last one ends in `<|return|>` (the answer) or `<|call|>` (a tool call), both
end of generation. The generation prompt ends in `<|start|>assistant`, so a reply starts inside a header.
Channel and recipient are ordinary text between the special tokens, so the tracker collects a header's
tokens and reads it, decoded, at `<|message|>`.

Kinds (runtime/replies/reasoning.py): header tokens and `<|end|>` are MARKER (no text); the analysis channel's
content is THINK; the final channel's, and commentary without a recipient (a preamble), ANSWER. A
message to a recipient (`to=functions.NAME`) is ANSWER text in call markup, `<|start|>HEADER<|message|>`
and the arguments (then `<|end|>` if another message follows): tool_calls.py's harmony parser
turns it into a call. With tools offered the tracker holds that parser (`calls`): the engine passes the
answer text through it after stop strings, and its events carry the calls as values (EngineEvent.answer),
so the markup never leaves the engine; without tools it stays answer text. A header that never reaches
`<|message|>` (interrupted by another special token, longer than MAX_HEADER_TOKENS, or cut off by the
end) is malformed: its text becomes answer text.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any, Union

from imp_jax.runtime.replies.reasoning import ANSWER, MARKER, THINK, ForcedEnd, ThinkMarkers
from imp_jax.runtime.replies.tool_calls import HarmonyParser

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
RETURN, CALL, CONSTRAIN = "<|return|>", "<|call|>", "<|constrain|>"
FINAL_HEADER = f"{END}{START}assistant{CHANNEL}final{MESSAGE}"   # what a forced end of the analysis writes
MAX_HEADER_TOKENS = 64
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=<\||\s|$)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z0-9_\-]+)")


@dataclasses.dataclass(frozen=True)
class Header:
    """A message header as read: the channel ("" when none) and recipient (None when none)."""

    text: str
    channel: str
    recipient: str | None

    @classmethod
    def parse(cls, text: str) -> Header:
        channel = _CHANNEL.search(text)
        recipient = _RECIPIENT.search(text)
        return cls(text, channel.group(1) if channel else "", recipient.group(1) if recipient else None)

    @property
    def kind(self) -> str:
        """THINK for analysis, ANSWER for anything else (final, preambles, calls)."""
        return THINK if self.channel == "analysis" and self.recipient is None else ANSWER


@dataclasses.dataclass(frozen=True)
class HarmonyMarkers:
    """The harmony special tokens of a tokenizer, and `decode` (special tokens spelled) to read headers."""

    start_id: int
    channel_id: int
    message_id: int
    end_id: int
    stop_ids: frozenset[int]             # <|return|> and <|call|>: the ends of a reply (EOS ids)
    constrain_id: int | None
    final_ids: tuple[int, ...]           # FINAL_HEADER's tokens: what a forced end emits
    decode: Callable[[Sequence[int]], str] = dataclasses.field(compare=False, repr=False)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> HarmonyMarkers | None:
        """The markers when the vocabulary speaks harmony: <|start|>, <|channel|>, <|message|> and <|end|>
        are single special tokens."""
        ids = [tokenizer.token_to_id(t) for t in (START, CHANNEL, MESSAGE, END)]
        special = getattr(tokenizer, "special_ids", frozenset())
        if any(i is None or i not in special for i in ids):
            return None
        stops = frozenset(i for i in (tokenizer.token_to_id(RETURN), tokenizer.token_to_id(CALL)) if i is not None)
        return cls(*ids, stops, tokenizer.token_to_id(CONSTRAIN),
                   tuple(tokenizer.encode(FINAL_HEADER, add_special_tokens=False)),
                   lambda t: tokenizer.decode(list(t), skip_special_tokens=False))

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset({self.start_id, self.channel_id, self.message_id, self.end_id, self.constrain_id,
                          *self.stop_ids}) - {None}

    def tracker(self, prompt_ids: Sequence[int], budget: int | None = None, tool_calls: bool = False) -> HarmonyTracker:
        return HarmonyTracker(self, prompt_ids, budget, tool_calls)


ReplyMarkers = Union[HarmonyMarkers, ThinkMarkers]


def reply_markers(tokenizer: Any) -> ReplyMarkers | None:
    """How a model's replies split into reasoning and answer: harmony messages (gpt-oss), else a <think> block;
    None when they do not (the model does not think). A model fact: the engine finds it once, at load."""
    return HarmonyMarkers.from_tokenizer(tokenizer) or ThinkMarkers.from_tokenizer(tokenizer)


class HarmonyTracker(ForcedEnd):
    """One sequence's place in its harmony reply (ThinkTracker's interface: observe, force_end, ...)."""

    def __init__(self, markers: HarmonyMarkers, prompt_ids: Sequence[int], budget: int | None = None,
                 tool_calls: bool = False):
        self.markers = markers
        self.calls = HarmonyParser() if tool_calls else None   # reads the calls out of the answer (tools offered)
        self.num_reasoning_tokens = 0
        self.budget = budget                 # reasoning tokens before the final message is forced (None: no cap)
        self._state = "between"              # header | content | between (after <|end|>: stray text is answer)
        self._header: list[int] = []         # the open header's tokens after <|start|> (the prompt's included)
        self._sampled: list[int] = []        # of them, the ones sampled (their text is answer text if malformed)
        self._message: Header | None = None  # the open message's header (None: a malformed one's text)
        self._pending = ""                   # answer text owed: call markup, a malformed header's text
        self._forced: list[int] = []         # final header tokens still to be sampled, next first
        self._end_on_open = False            # end_thinking came before an analysis message opened
        self._answered = False               # the final message began: nothing left to end
        self._start_sampled = False          # the open header's <|start|> was sampled (not the prompt's)
        start = max((i for i, t in enumerate(prompt_ids) if t == markers.start_id), default=None)
        if start is not None:                # the prompt's last message: usually the open `<|start|>assistant`
            for t in prompt_ids[start:]:
                self._step(t, sampled=False)
            self._pending, self.num_reasoning_tokens = "", 0

    # ------------------------------------------------------------------ ThinkTracker's interface
    def observe(self, token: int) -> str:
        """Advance past a sampled token; returns its kind (THINK, MARKER or ANSWER)."""
        if self._forced:
            self._forced.pop(0)
        kind = self._step(token, sampled=True)
        if kind == THINK:
            self.num_reasoning_tokens += 1
            if self.budget is not None and self.num_reasoning_tokens >= self.budget:
                self.force_end()
        return kind

    @property
    def thinking(self) -> bool:
        """Inside an analysis message's content."""
        return self._state == "content" and self._message is not None and self._message.kind == THINK

    def force_end(self) -> str:
        """End the analysis: its `<|end|>` and a final message's header are the next tokens. "ending", or
        "already_closed" once the final message began (or an end is on its way)."""
        if self._forced or self._answered or self._end_on_open:
            return "already_closed"
        if self.thinking:
            self._forced = list(self.markers.final_ids)
        else:   # in a header or between messages: end the next analysis as soon as it opens
            self._end_on_open = True
        return "ending"

    @property
    def constrained(self) -> bool:
        """A grammar (an output format) applies to the final message's content only."""
        m = self._message
        return (self._state == "content" and not self._forced and m is not None and m.channel == "final"
                and m.recipient is None)

    @property
    def may_open(self) -> bool:
        """No marker joins a grammar's tokens: the grammar starts inside the final message."""
        return False

    def answer_text(self, delta: str) -> str:
        """The answer's delta, after the text owed (call markup, a malformed header)."""
        text, self._pending = self._pending + delta, ""
        return text

    def finish_text(self) -> str:
        """At the end of the reply: the text still owed (a header cut off is text)."""
        if self._state == "header":
            self._malformed()
        return self.answer_text("")

    # ------------------------------------------------------------------ the state machine
    def _step(self, token: int, sampled: bool) -> str:
        m = self.markers
        ends = token == m.end_id or token in m.stop_ids
        if token == m.start_id:
            if self._state == "header":
                self._malformed()
            self._close_message()
            self._state, self._header, self._sampled, self._start_sampled = "header", [], [], sampled
            return MARKER
        if self._state == "header":
            if token == m.message_id:
                self._open_message(sampled)
            elif ends:
                self._malformed()
                self._state = "between"
            elif len(self._header) >= MAX_HEADER_TOKENS:
                self._malformed()
                self._state, self._message = "content", None   # the rest of the message is text
                return ANSWER
            else:
                self._header.append(token)
                if sampled:
                    self._sampled.append(token)
            return MARKER
        if self._state == "content":
            if not ends:
                return self._message.kind if self._message is not None else ANSWER
            if self.thinking:
                self.num_reasoning_tokens += 1
            if token == m.end_id:   # <|call|> and <|return|> end the reply: nothing follows to tell apart
                self._close_message()
            self._state, self._message = "between", None
            return MARKER
        return MARKER if ends else ANSWER

    def _open_message(self, sampled: bool) -> None:
        header = Header.parse(self.markers.decode(self._header))
        self._state, self._message = "content", header
        if header.kind == THINK:
            # the analysis's sampled header tokens count as reasoning: <|start|>, its text, <|message|>
            self.num_reasoning_tokens += self._start_sampled + len(self._sampled) + sampled
            if self._end_on_open or self.budget == 0:
                self._end_on_open = False
                self._forced = list(self.markers.final_ids)
        elif header.recipient is not None:
            self._pending += f"{START}{header.text}{MESSAGE}"
        elif header.channel == "final":
            self._answered = True
        self._header, self._sampled = [], []

    def _close_message(self) -> None:
        """A message to a recipient ends: its markup closes (the parser also closes it at the reply's end)."""
        if self._state == "content" and self._message is not None and self._message.recipient is not None:
            self._pending += END

    def _malformed(self) -> None:
        """The open header never reached <|message|>: its sampled tokens' text is answer text."""
        ordinary = [t for t in self._sampled if t not in self.markers.special_ids]
        if ordinary:
            self._pending += self.markers.decode(ordinary)
        self._header, self._sampled = [], []
