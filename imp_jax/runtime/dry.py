"""DRY ("Don't Repeat Yourself") penalty, llama.cpp's semantics, computed on the host.

A token that would extend a repeat of the history's suffix of length L >= allowed_length gets
multiplier * base ** (L - allowed_length) subtracted from its logit (the exponent clamped so the power
stays a finite f32). L is the longest match, over every earlier position, of the history's suffix
ending just before the candidate token; a sequence breaker ("\\n", ":", ...) caps L at the number of
tokens after the most recent breaker, and a single-token breaker is never penalised.

Why the host: the match lengths come from a Z-algorithm over the history (linear, branchy, different
per row), and only a handful of tokens get a penalty. The host computes them per row from the full
history (prompt + output, the last `penalty_last_n` tokens; -1 = the context size) and the compiled
sampler takes them as a sparse [R, DRY_SLOTS] (token id, penalty) input it subtracts in one scatter,
skipped when no row has a DRY slot; no [R, V] pass is added. A row keeps its DRY_SLOTS largest
penalties (in practice a repeat's candidates are a few tokens). Because the penalties need the newest
token, a DRY row is never overlapped with the next step's launch (engine `_overlappable`).

Breakers, as llama.cpp's `get_overlapping_token_sequences`: each breaker string (at most
MAX_BREAKER_CHARS characters) is a single-token breaker for every vocabulary token whose text contains
it, and a head + tail sequence for every token whose text ends with a prefix of it (the tail is the
tokenisation of the rest, at most MAX_BREAKER_TAIL tokens).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DRY_SLOTS = 32                          # penalised tokens per row (a static width of the compiled sampler)
DEFAULT_BREAKERS = ("\n", ":", "\"", "*")
MAX_BREAKERS = 16                       # strings per request
MAX_BREAKER_CHARS = 40                  # llama.cpp's MAX_CHAR_LEN
MAX_BREAKER_TAIL = 20                   # llama.cpp's MAX_SEQ_LEN
MAX_DRY_MULTIPLIER = 100.0
MAX_DRY_BASE = 10.0
FLOAT_MAX_LOG = 88.7228391              # log(f32 max): caps the exponent

# head token -> the tails that, after it, complete a breaker (an empty tail: the head alone is one)
Breakers = dict[int, list[tuple[int, ...]]]


@dataclass(frozen=True)
class DryParams:
    """A request's DRY knobs; multiplier 0 is off."""

    multiplier: float = 0.0
    base: float = 1.75
    allowed_length: int = 2
    penalty_last_n: int = -1            # -1 = the context size, 0 = off
    sequence_breakers: tuple[str, ...] = field(default=DEFAULT_BREAKERS)

    @property
    def on(self) -> bool:
        """llama.cpp's `dry_enabled`."""
        return self.multiplier != 0 and self.base >= 1 and self.penalty_last_n != 0


def repeat_penalties(history: Sequence[int], p: DryParams, breakers: Breakers, context_size: int) -> dict[int, float]:
    """Token id -> the DRY penalty (to subtract from its logit) for the next token after `history`."""
    last_n = context_size if p.penalty_last_n == -1 else max(p.penalty_last_n, 0)
    tokens = list(history)[-min(last_n, context_size):] if last_n else []
    n = len(tokens)
    if not p.on or n <= p.allowed_length:
        return {}
    rev = tokens[::-1]                  # rev[i] = the i-th token from the end
    rep_limit = _rep_limit(rev, breakers)
    if rep_limit < p.allowed_length:
        return {}
    z = _z_array(rev)                   # z[k]: the suffix also ends k tokens before the end, z[k] long
    longest: dict[int, int] = {}
    for k in range(1, n):
        length = min(z[k], rep_limit)
        if length >= p.allowed_length:
            tok = rev[k - 1]            # the token that followed that earlier occurrence
            if longest.get(tok, -1) < length:
                longest[tok] = length
    max_exp = int(FLOAT_MAX_LOG / np.log(p.base)) if p.base > 1.000001 else 0
    out = {}
    for tok, length in longest.items():
        if () in breakers.get(tok, ()):
            continue                    # a single-token breaker is never penalised
        exp = length - p.allowed_length
        if max_exp > 0:
            exp = min(exp, max_exp)
        out[tok] = float(np.float32(p.multiplier) * np.float32(p.base) ** np.float32(exp))
    return out


def _rep_limit(rev: list[int], breakers: Breakers) -> int:
    """How many tokens a repeat may span: those after the most recent complete breaker."""
    for i, tok in enumerate(rev):
        best = -1
        for tail in breakers.get(tok, ()):
            if best < len(tail) <= i and all(tail[j] == rev[i - j - 1] for j in range(len(tail))):
                best = len(tail)
        if best >= 0:
            return i - best
    return len(rev)


def _z_array(s: list[int]) -> list[int]:
    """z[k] = the length of the longest common prefix of s and s[k:] (z[0] = 0), in linear time."""
    n = len(s)
    z = [0] * n
    left = right = 0
    for k in range(1, n):
        if k < right:
            z[k] = min(right - k, z[k - left])
        while k + z[k] < n and s[z[k]] == s[k + z[k]]:
            z[k] += 1
        if k + z[k] > right:
            left, right = k, k + z[k]
    return z


def top_slots(penalties: dict[int, float], slots: int = DRY_SLOTS) -> list[tuple[int, float]]:
    """The `slots` largest penalties (ties by token id), the ones the sampler's fixed width keeps."""
    return sorted(penalties.items(), key=lambda kv: (-kv[1], kv[0]))[:slots]


class BreakerTable:
    """Breaker strings -> token sequences for one tokenizer; the vocabulary's texts are decoded once."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._texts: list[str] | None = None

    def breakers(self, strings: Sequence[str]) -> Breakers:
        """The merged head -> tails map of `strings`."""
        out: Breakers = {}
        for s in strings:
            for head, tails in self._one(s[:MAX_BREAKER_CHARS]).items():
                merged = out.setdefault(head, [])
                merged.extend(t for t in tails if t not in merged)
        return out

    @functools.lru_cache(maxsize=64)  # noqa: B019 - one table per engine, kept as long as it
    def _one(self, s: str) -> Breakers:
        out: Breakers = {}
        if not s:
            return out
        for tok, word in enumerate(self._vocab_texts()):
            if s in word:
                out.setdefault(tok, []).append(())
                continue
            pos = word.find(s[0])
            while pos >= 0:
                rest = len(word) - pos   # the word ends with s[:rest]?
                if rest < len(s) and word[pos:] == s[:rest]:
                    tail = tuple(self._tokenizer.encode(s[rest:], add_special_tokens=False,
                                                        parse_special=False)[:MAX_BREAKER_TAIL])
                    if tail not in out.setdefault(tok, []):
                        out[tok].append(tail)
                pos = word.find(s[0], pos + 1)
        return out

    def _vocab_texts(self) -> list[str]:
        if self._texts is None:
            ids = [[i] for i in range(self._vocab_size)]
            backend = getattr(self._tokenizer, "backend", None)
            self._texts = (backend.decode_batch(ids, skip_special_tokens=False) if backend is not None
                           else [self._tokenizer.decode(i, skip_special_tokens=False) for i in ids])
        return self._texts
