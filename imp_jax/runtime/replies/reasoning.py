"""Reasoning: a thinking model's reply is a think block (`<think> ... </think>`) and then the answer.

The engine tracks, per sequence, which side of the block each sampled token is on (by token id:
the markers must be single tokens). The think side's text goes to the event's `reasoning_text`;
stop strings and the grammar constraint apply to the answer side only. `force_end` (the
end_thinking command, or a think budget running out) makes the next sampled tokens the end
marker, through the allowed-token mask, so the answer continues on the same KV.

Token kinds: THINK (reasoning text), MARKER (a marker or a forced end token: no text, counted as
reasoning), ANSWER (answer text).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

THINK_START, THINK_END = "<think>", "</think>"
DEFAULT_AFTER_END = "\n\n"   # what Qwen3 and DeepSeek-R1 templates put after </think>
THINK, MARKER, ANSWER = "think", "marker", "answer"


@dataclasses.dataclass(frozen=True)
class ThinkMarkers:
    """The model's think markers: `end_ids` is what a forced end emits (</think> plus the template's gap)."""

    start_id: int
    end_id: int
    end_ids: tuple[int, ...]

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> ThinkMarkers | None:
        """The markers when the model thinks: both are single tokens and a chat template writes </think>."""
        start, end = tokenizer.token_to_id(THINK_START), tokenizer.token_to_id(THINK_END)
        templates = getattr(tokenizer, "chat_templates", None) or {}
        if start is None or end is None or not any(THINK_END in t for t in templates.values()):
            return None
        return cls(start, end, (end, *tokenizer.encode(_after_end(tokenizer), add_special_tokens=False)))

    def tracker(self, prompt_ids: Sequence[int], budget: int | None = None, tool_calls: bool = False) -> ThinkTracker:
        """A sequence's tracker. `tool_calls` (HarmonyMarkers.tracker's) changes nothing here: a think-block model
        writes its calls as answer text, which the server parses."""
        return ThinkTracker(self, prompt_ids, budget)

    def opens_think(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the prompt ends inside a think block (a template or prefill left `<think>` open)."""
        for t in reversed(prompt_ids):
            if t == self.end_id:
                return False
            if t == self.start_id:
                return True
        return False


def _after_end(tokenizer: Any) -> str:
    """What the template writes after </think> in its no-thinking prefill (Qwen3: "\\n\\n")."""
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                             enable_thinking=False)
    except Exception:  # a template that needs more than this probe: use the common gap
        return DEFAULT_AFTER_END
    return text.rsplit(THINK_END, 1)[1] if THINK_END in text else DEFAULT_AFTER_END


class ForcedEnd:
    """The forced-end state a reasoning tracker keeps (ThinkTracker; HarmonyTracker, runtime/replies/harmony.py):
    the end tokens still to be sampled, whether an end was asked before the reasoning opened, the budget."""

    _forced: list[int]
    _end_on_open: bool
    budget: int | None

    @property
    def forced_token(self) -> int | None:
        """The token the next sample must be (a forced end in progress), else None."""
        return self._forced[0] if self._forced else None

    @property
    def may_force(self) -> bool:
        """Whether observing a token may start (or is in) a forced end: the next step's mask then
        depends on the token just sampled (the engine reads it before launching that step)."""
        return self.may_force_within(1)

    def may_force_within(self, tokens: int) -> bool:
        """Whether observing the next `tokens` tokens may start (or is in) a forced end."""
        return bool(self._forced) or self._end_on_open or self._near_budget(tokens)

    def _near_budget(self, tokens: int) -> bool:
        """Whether the next `tokens` observed tokens may reach the budget (here: whenever there is one)."""
        return self.budget is not None


def answer_reserve(max_tokens: int) -> int:
    """Tokens of `max_tokens` kept for the answer of a thinking model: imp's max(256, max_tokens / 4), at
    most half of `max_tokens` (so a short request still thinks: 120 tokens keep 60 for the answer)."""
    return min(max(256, max_tokens // 4), max_tokens // 2)


def default_think_budget(max_tokens: int) -> int:
    """The think block's budget when a request sets none: what `answer_reserve` leaves; when it is spent
    the engine ends the block (as end_thinking does) and the answer has the reserve."""
    return max_tokens - answer_reserve(max_tokens)


class ThinkTracker(ForcedEnd):
    """One sequence's place relative to its think block, and the forced end still to emit."""

    calls = None   # no call parser in the engine (HarmonyTracker.calls): the server reads this reply's calls

    def __init__(self, markers: ThinkMarkers, prompt_ids: Sequence[int], budget: int | None = None):
        self.markers = markers
        self.thinking = markers.opens_think(prompt_ids)
        self.num_reasoning_tokens = 0
        self.budget = budget                  # reasoning tokens before the end is forced (None: no cap)
        self._forced: list[int] = []          # end tokens still to be sampled, next first
        self._end_on_open = False             # end_thinking came before the model opened its block
        self._closed = False                  # the block ended, or the answer began without one
        self._strip_newlines = False          # the answer's leading newlines are dropped (as templates do)

    def _near_budget(self, tokens: int) -> bool:
        # counted one token at a time here: only tokens that may reach the budget need the engine to read
        # them before the next launch (asynchronous scheduling and drafts stay on for the rest of the block)
        return self.budget is not None and self.num_reasoning_tokens + tokens >= self.budget

    def observe(self, token: int) -> str:
        """Advance past a sampled token; returns its kind (THINK, MARKER or ANSWER)."""
        if self._forced:
            self._forced.pop(0)
            self.num_reasoning_tokens += 1
            if token == self.markers.end_id:
                self._close()
            return MARKER
        if self.thinking:
            self.num_reasoning_tokens += 1
            if token == self.markers.end_id:
                self._close()
                return MARKER
            if self.budget is not None and self.num_reasoning_tokens >= self.budget:
                self.force_end()
            return THINK
        if token == self.markers.start_id and not self._closed:
            self.thinking = True
            self.num_reasoning_tokens += 1
            if self._end_on_open or self.budget == 0:
                self.force_end()
            return MARKER
        self._closed = True
        return ANSWER

    def _close(self) -> None:
        self.thinking, self._closed = False, True
        self._strip_newlines = True

    def force_end(self) -> str:
        """Make the next tokens the end marker: "ending", or "already_closed" when the block is over."""
        if self._forced or self._closed or (not self.thinking and self._end_on_open):
            return "already_closed"
        if self.thinking:
            self._forced = list(self.markers.end_ids)
        else:  # the model has not opened its block yet: close it as soon as it does
            self._end_on_open = True
        return "ending"


    @property
    def constrained(self) -> bool:
        """Whether the answer's grammar applies to the next token (not inside the block or its forced end)."""
        return not self.thinking and not self._forced

    @property
    def may_open(self) -> bool:
        """Whether the next token may still open the think block (nothing but markers sampled yet)."""
        return not self.thinking and not self._closed and not self._forced

    def answer_text(self, delta: str) -> str:
        """The answer's delta with the newlines right after </think> dropped."""
        if self._strip_newlines:
            delta = delta.lstrip("\n")
            self._strip_newlines = not delta
        return delta

    def finish_text(self) -> str:
        """Answer text owed at the end of the reply (a harmony tracker may owe some; this one never does)."""
        return ""
