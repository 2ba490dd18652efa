"""banned_strings / banned_regex: which banned phrase a sequence's new text completes, in which token it
starts, and how much of the text must stay held back because a phrase may still complete in it.

The engine (runtime/core/engine.py) feeds each answer token's text to a BannedFilter. A completed phrase
makes the engine rewind the sequence to the token the phrase starts in, ban that token at that
position and sample again; text is released to the client only once no phrase can still complete
in it, so nothing streamed is ever taken back. Matching is case-sensitive, on the decoded text.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

import regex

from imp_jax.errors import InvalidRequestError

try:   # Python's own regex parser (3.11+ names), read to find backtracking shapes; not a matcher
    from re import _constants as _sre_c
    from re import _parser as _sre_parser
except ImportError:   # pragma: no cover - older Pythons
    import sre_constants as _sre_c  # type: ignore[no-redef]
    import sre_parse as _sre_parser  # type: ignore[no-redef]

log = logging.getLogger("imp_jax.banned")

MAX_BANNED_STRINGS = 64
MAX_BANNED_REGEX = 16
MAX_PHRASE_BYTES = 256     # each string or pattern, UTF-8
REGEX_WINDOW_BYTES = 256   # a regex match must lie in the text's last 256 bytes and end in new text
REGEX_HOLD_BYTES = 255     # with patterns, the last 255 bytes wait until later text passes them
MAX_REWINDS = 64           # per request; past it, phrases pass
REGEX_TIMEOUT_S = 0.05     # per pattern and token at most (less when the request's budget has less left) ...
REGEX_MIN_TIMEOUT_S = 0.005  # ... but never less: a search's wall time includes waits for the CPU and the GIL
REGEX_BUDGET_S = 0.002     # a request's regex time in hand at first and at most (its choices share it) ...
REGEX_S_PER_TOKEN = 0.0005  # ... refilled by this much per answer token fed; spent, the request ends
REGEX_SPENT = ("banned_regex: the request's regex time budget is spent (its patterns took over "
               f"{REGEX_S_PER_TOKEN * 1e3:g} ms per token)")
REGEX_SPENT_EXTRA = {"code": "regex_time_spent", "param": "banned_regex"}   # on the ending event: a 400 naming it


def _utf8_len(ch: str) -> int:
    c = ord(ch)
    return 1 if c < 0x80 else 2 if c < 0x800 else 3 if c < 0x10000 else 4


def tail_chars(text: str, max_bytes: int) -> int:
    """How many trailing characters of `text` fit in `max_bytes` UTF-8 bytes."""
    n = total = 0
    for ch in reversed(text):
        total += _utf8_len(ch)
        if total > max_bytes:
            break
        n += 1
    return n


@functools.lru_cache(maxsize=256)
def compile_pattern(pattern: str) -> Any:
    """A banned_regex pattern compiled (PCRE-like, the `regex` package); raises regex.error if it does not."""
    return regex.compile(pattern)


def check_phrases(strings: Sequence[str], patterns: Sequence[str]) -> None:
    """400 naming the field for a list too long, a phrase empty or over 256 bytes, a pattern that does not
    compile or that matches the empty string."""
    for name, items, limit in (("banned_strings", strings, MAX_BANNED_STRINGS),
                               ("banned_regex", patterns, MAX_BANNED_REGEX)):
        if len(items) > limit:
            raise InvalidRequestError(f"'{name}' has {len(items)} entries; at most {limit} are allowed", param=name)
        for s in items:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"'{name}' entries must be non-empty strings", param=name)
            if len(s.encode("utf-8", "surrogatepass")) > MAX_PHRASE_BYTES:
                raise InvalidRequestError(f"'{name}' entries must be at most {MAX_PHRASE_BYTES} bytes (UTF-8)",
                                          param=name)
    for p in patterns:
        try:
            compiled = compile_pattern(p)
        except (regex.error, ValueError, OverflowError) as e:
            raise InvalidRequestError(f"'banned_regex' pattern {p!r} does not compile: {e}",
                                      param="banned_regex") from None
        if compiled.search("") is not None:
            raise InvalidRequestError(f"'banned_regex' pattern {p!r} matches the empty string", param="banned_regex")
        why = backtracking_risk(p)
        if why is not None:
            raise InvalidRequestError(f"'banned_regex' pattern {p!r} can backtrack catastrophically ({why}); "
                                      "rewrite it without that, or use an atomic group / possessive quantifier",
                                      param="banned_regex")


def backtracking_risk(pattern: str) -> str | None:
    """Why `pattern` may take exponential time on a short text, or None: a repeated group that holds
    another quantifier or can match nothing, or alternatives under a repeat that can start alike
    (polynomial shapes such as `a*a*a*b` pass: the time budget bounds them). Patterns Python's parser
    does not read (`regex`-only syntax) pass; the request's time budget still bounds them."""
    try:
        tree = _sre_parser.parse(pattern)
    except Exception:   # noqa: BLE001 - any syntax re does not know
        return None
    return _risk(tree.data if hasattr(tree, "data") else list(tree), repeated=False)


def _risk(items: list, repeated: bool) -> str | None:
    for op, arg in items:
        if op in (_sre_c.MAX_REPEAT, _sre_c.MIN_REPEAT):
            lo, hi, sub = arg
            if hi > 1 and repeated:
                return "a quantifier inside a repeated group"
            if hi > 1 and _nullable(list(sub)):
                return "a repeated group that can match the empty string"
            why = _risk(list(sub), repeated or hi > 1)
            if why is not None:
                return why
        elif op in (_sre_c.SUBPATTERN, _sre_c.ASSERT, _sre_c.ASSERT_NOT):
            why = _risk(list(arg[-1]), repeated)
            if why is not None:
                return why
        elif op is _sre_c.BRANCH:
            branches = [list(b) for b in arg[1]]
            if repeated and not _distinct_starts(branches):
                return "alternatives that can start alike inside a repeated group"
            for b in branches:
                why = _risk(b, repeated)
                if why is not None:
                    return why
        # atomic groups and possessive repeats never backtrack into themselves: not looked into
    return None


def _nullable(items: list) -> bool:
    """Whether a parsed sequence can match the empty string (anchors and lookarounds do)."""
    for op, arg in items:
        if op in (_sre_c.MAX_REPEAT, _sre_c.MIN_REPEAT, _sre_c.POSSESSIVE_REPEAT):
            if arg[0] > 0 and not _nullable(list(arg[2])):
                return False
        elif op in (_sre_c.SUBPATTERN, _sre_c.ATOMIC_GROUP):
            if not _nullable(list(arg[-1] if op is _sre_c.SUBPATTERN else arg)):
                return False
        elif op is _sre_c.BRANCH:
            if not any(_nullable(list(b)) for b in arg[1]):
                return False
        elif op not in (_sre_c.AT, _sre_c.ASSERT, _sre_c.ASSERT_NOT):
            return False
    return True


def _distinct_starts(branches: list[list]) -> bool:
    """Whether every alternative begins with a literal character no other one begins with."""
    firsts = [b[0][1] if b and b[0][0] is _sre_c.LITERAL else None for b in branches]
    return None not in firsts and len(set(firsts)) == len(firsts)


class BannedPhrases:
    """A request's banned strings and compiled patterns (immutable, shared by its choices)."""

    def __init__(self, strings: Sequence[str], patterns: Sequence[str]):
        self.strings = tuple(dict.fromkeys(strings))
        self.patterns = tuple(compile_pattern(p) for p in dict.fromkeys(patterns))
        self._max_len = max((len(s) for s in self.strings), default=0)

    def find(self, text: str, new_from: int, budget: RewindBudget | None = None) -> int | None:
        """The start of the leftmost phrase in `text` that ends past `new_from` (in the new text), or None.
        Pattern searches spend `budget`'s regex time (each stops at its timeout or what is left)."""
        best: int | None = None
        for s in self.strings:   # an occurrence starting there or later ends in the new text
            at = text.find(s, max(0, new_from - len(s) + 1))
            if at >= 0 and (best is None or at < best):
                best = at
        if self.patterns:
            start = len(text) - tail_chars(text, REGEX_WINDOW_BYTES)
            budget = budget if budget is not None else RewindBudget()
            for p in self.patterns:
                if budget.regex_s <= 0:
                    break
                # the budget counts this thread's CPU time, so a busy machine (or the GIL) spends none of it
                t0 = time.thread_time()
                timeout = min(REGEX_TIMEOUT_S, max(budget.regex_s, REGEX_MIN_TIMEOUT_S))
                at = self._first_regex(p, text, start, new_from, timeout)
                budget.regex_s -= time.thread_time() - t0
                if at is not None and (best is None or at < best):
                    best = at
        return best

    @staticmethod
    def _first_regex(p: Any, text: str, start: int, new_from: int, timeout: float) -> int | None:
        """The leftmost non-empty match of `p` in text[start:] that ends past `new_from`; None on a timeout."""
        try:
            for m in p.finditer(text, pos=start, overlapped=True, timeout=timeout):
                if m.end() > new_from and m.end() > m.start():
                    return m.start()
        except TimeoutError:
            log.warning("banned_regex_timeout pattern=%r", p.pattern)
        return None

    def hold(self, text: str) -> int:
        """How many trailing characters of `text` a phrase may still complete in: the longest suffix that
        is a proper prefix of a string, and with patterns at least the last 255 bytes."""
        keep = tail_chars(text, REGEX_HOLD_BYTES) if self.patterns else 0
        tail = text[-(self._max_len - 1):] if self._max_len > 1 else ""
        for s in self.strings:
            i = tail.find(s[0])
            while 0 <= i and len(tail) - i > keep:
                if s.startswith(tail[i:]):
                    keep = len(tail) - i
                    break
                i = tail.find(s[0], i + 1)
        return keep


@dataclasses.dataclass
class RewindBudget:
    """A request's rewinds left and regex time in hand (seconds), shared by its choices."""

    left: int = MAX_REWINDS
    regex_s: float = REGEX_BUDGET_S


@dataclasses.dataclass
class _Held:
    position: int          # the token's index in the sequence's output
    token: int
    logprobs: list | None  # its TokenLogprob entries, emitted with it
    start: int             # where its text begins in the filter's pending text
    detok: tuple           # the detokenizer's state before the token (IncrementalDetokenizer.snapshot)


class BannedFilter:
    """One sequence's held-back tokens and text, and its bans: position -> token ids sampled there never again."""

    def __init__(self, phrases: BannedPhrases, budget: RewindBudget):
        self.phrases = phrases
        self.budget = budget
        self.bans: dict[int, list[int]] = {}
        self._held: list[_Held] = []
        self._text = ""   # the held tokens' text: nothing of it has reached the client

    @property
    def active(self) -> bool:
        """Whether phrases are still enforced (the request has rewinds left)."""
        return self.budget.left > 0

    @property
    def out_of_time(self) -> bool:
        """Whether the request's patterns spent its regex time: the engine ends the sequence (REGEX_SPENT)."""
        return bool(self.phrases.patterns) and self.budget.regex_s <= 0

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def push(self, position: int, token: int, logprobs: list | None, detok_state: tuple) -> None:
        """A sampled answer token, before its text is fed."""
        self._held.append(_Held(position, token, logprobs, len(self._text), detok_state))

    def feed(self, delta: str) -> int | None:
        """The newest token's text; the held index of the token a completed phrase starts in, else None."""
        new_from = len(self._text)
        self._text += delta
        if not delta:
            return None
        if self.phrases.patterns:
            self.budget.regex_s = min(REGEX_BUDGET_S, self.budget.regex_s + REGEX_S_PER_TOKEN)
        at = self.phrases.find(self._text, new_from, self.budget)
        if at is None:
            return None
        return max(i for i, h in enumerate(self._held) if h.start <= at)

    def rewind(self, index: int) -> _Held:
        """Drop held tokens index.. (their text too), ban the first at its position, spend one rewind;
        returns that token's entry (its position and the detokenizer state to restore)."""
        h = self._held[index]
        del self._held[index:]
        self._text = self._text[:h.start]
        for p in [p for p in self.bans if p > h.position]:
            del self.bans[p]   # later positions belong to the discarded continuation
        self.bans.setdefault(h.position, []).append(h.token)
        self.budget.left -= 1
        return h

    def release(self) -> tuple[list[int], list, str]:
        """(token ids, their logprobs, their text) of the held tokens no phrase can still complete in:
        whole tokens only, so a later rewind never takes back text that went out."""
        cut = len(self._text) - self.phrases.hold(self._text)
        n = 0
        while n < len(self._held) and self._end(n) <= cut:
            n += 1
        return self._take(n)

    def _end(self, n: int) -> int:
        """Where held token n's text ends."""
        return self._held[n + 1].start if n + 1 < len(self._held) else len(self._text)

    def flush(self) -> tuple[list[int], list, str]:
        """Every held token: at the end of the sequence, or once phrases no longer apply."""
        return self._take(len(self._held))

    def _take(self, n: int) -> tuple[list[int], list, str]:
        if n == 0:
            return [], [], ""
        end = self._end(n - 1)
        taken, self._held = self._held[:n], self._held[n:]
        text, self._text = self._text[:end], self._text[end:]
        for h in self._held:
            h.start -= end
        logprobs = [lp for h in taken for lp in (h.logprobs or [])]
        return [h.token for h in taken], logprobs, text
