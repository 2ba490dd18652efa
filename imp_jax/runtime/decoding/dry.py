"""DRY ("Don't Repeat Yourself") penalty, llama.cpp's semantics, computed on the host.

A token that would extend a repeat of the history's suffix of length L >= allowed_length gets
multiplier * base ** (L - allowed_length) subtracted from its logit (the exponent clamped so the power
stays a finite f32). L is the longest match, over every earlier position, of the history's suffix
ending just before the candidate token; a sequence breaker ("\\n", ":", ...) caps L at the number of
tokens after the most recent breaker, and a single-token breaker is never penalised.

Why the host: the match lengths are branchy and different per row, and only a handful of tokens get a
penalty. `repeat_penalties` states them over the whole history (prompt + output, the last
`penalty_last_n` tokens; -1 = the context size) with a Z-algorithm and is the reference; the engine
keeps a DryState per sequence that is fed each accepted token and gives the same answer without
rescanning the history (its cost per token: the earlier occurrences of the newest few tokens). The compiled
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

import bisect
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import regex

DRY_SLOTS = 32                          # penalised tokens per row (a static width of the compiled sampler)
DEFAULT_BREAKERS = ("\n", ":", "\"", "*")
MAX_BREAKERS = 16                       # strings per request
MAX_BREAKER_CHARS = 40                  # llama.cpp's MAX_CHAR_LEN
MAX_BREAKER_TAIL = 20                   # llama.cpp's MAX_SEQ_LEN
MAX_DRY_MULTIPLIER = 100.0
MAX_DRY_BASE = 10.0
FLOAT_MAX_LOG = 88.7228391              # log(f32 max): caps the exponent
BREAKER_CACHE = 64                      # distinct breaker sets kept per tokenizer (LRU)

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
    return _to_penalties(longest, p, {t for t, tails in breakers.items() if () in tails})


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


class DryState:
    """One sequence's DRY matches, kept as tokens are accepted: `penalties` gives exactly
    `repeat_penalties` over the same history without rescanning it.

    For each earlier position j whose last `gram` tokens (min(allowed_length, 4), at least 1) equal the
    history's, `_match[j]` is how far the match with the history's suffix reaches back; a new token x
    keeps j + 1 with one more when token j + 1 is x, and those are exactly the occurrences of the new
    last gram, so a token costs the gram's earlier occurrences in the window (a bigram's handful in
    prose; n / period in a looping history), never the whole history. The breaker in force (the most
    recent head with a complete tail) is updated from the last MAX_BREAKER_TAIL + 1 heads. A shorter
    or different history (a rewind) rebuilds from the window: O(window), once per rewind."""

    def __init__(self, params: DryParams, breakers: Breakers, context_size: int):
        last_n = context_size if params.penalty_last_n == -1 else max(params.penalty_last_n, 0)
        self.params, self.window = params, min(last_n, context_size)
        self.gram = min(max(params.allowed_length, 1), 4)
        self._tails = {head: set(tails) for head, tails in breakers.items()}
        self._exempt = {head for head, tails in breakers.items() if () in tails}
        self._reset([])

    def _reset(self, tokens: list[int], seen_from: int = 0) -> None:
        self.tokens = tokens
        self._occ: dict[tuple[int, ...], deque[int]] = {}   # gram -> its end positions, ascending
        self._match: dict[int, int] = {}     # end position -> match length (>= gram; cut at the window later)
        self._breaker = (-1, 0)              # (head position, longest complete tail) of the breaker in force
        self._seen: Counter[int] = Counter() # allowed_length 0: tokens at positions _seen_from.. (each one counts)
        self._seen_from = seen_from

    def penalties(self, prompt: Sequence[int], output: Sequence[int]) -> dict[int, float]:
        """Token id -> penalty for the token after prompt + output (`repeat_penalties`' answer)."""
        self.sync(prompt, output)
        p, n = self.params, len(self.tokens)
        start = max(0, n - self.window)
        if not p.on or n - start <= p.allowed_length:
            return {}
        head, tail = self._breaker
        rep_limit = n - start if head < start else n - 1 - head - tail
        if rep_limit < p.allowed_length:
            return {}
        longest: dict[int, int] = {}
        h = self.tokens
        for j, m in self._match.items():
            length = min(m, j - start + 1, rep_limit)
            if length >= p.allowed_length and longest.get(h[j + 1], -1) < length:
                longest[h[j + 1]] = length
        if p.allowed_length == 0:            # a match of length 0 counts too: every token after `start`
            for q in range(self._seen_from, start + 1):
                self._seen[h[q]] -= 1
            self._seen_from = max(self._seen_from, start + 1)
            for tok, count in self._seen.items():
                if count > 0:
                    longest.setdefault(tok, 0)
        return _to_penalties(longest, p, self._exempt)

    def sync(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Catch up with the sequence's tokens: feed the new ones; rebuild if they were cut or differ."""
        n, have, k = len(prompt) + len(output), len(self.tokens), len(prompt)
        common = min(n, have)
        at = common - 1
        if common and (prompt[at] if at < k else output[at - k]) != self.tokens[at]:
            common = 0                       # not a cut of what it saw: start again
        if common < have:
            start = max(0, common - self.window)
            self._reset(list(prompt[:common]) + list(output[:max(0, common - k)]), seen_from=start)
            for q in range(start, common):
                self._advance(q)
        for q in range(common, n):
            self.tokens.append(prompt[q] if q < k else output[q - k])
            self._advance(q)

    def _advance(self, q: int) -> None:
        """Account for token q (already in self.tokens) as the newest."""
        h, g = self.tokens, self.gram
        start = max(0, q + 1 - self.window)
        if self.params.allowed_length == 0 and q >= self._seen_from:
            self._seen[h[q]] += 1
        if q + 1 >= g:
            occ = self._occ.setdefault(tuple(h[q + 1 - g:q + 1]), deque())
            while occ and occ[0] < start:
                occ.popleft()
            old = self._match
            self._match = {j: old.get(j - 1, g - 1) + 1 for j in occ}
            occ.append(q)
        for length in range(min(MAX_BREAKER_TAIL, q) + 1):
            head = q - length
            tails = self._tails.get(h[head])
            if tails and tuple(h[head + 1:q + 1]) in tails and head >= self._breaker[0]:
                best = self._breaker[1] if head == self._breaker[0] else -1
                self._breaker = (head, max(best, length))


def _to_penalties(longest: dict[int, int], p: DryParams, exempt: set[int]) -> dict[int, float]:
    """Match lengths -> penalties (single-token breakers exempt, the exponent clamped to a finite f32)."""
    max_exp = int(FLOAT_MAX_LOG / np.log(p.base)) if p.base > 1.000001 else 0
    out = {}
    for tok, length in longest.items():
        if tok in exempt:
            continue
        exp = length - p.allowed_length
        if max_exp > 0:
            exp = min(exp, max_exp)
        out[tok] = float(np.float32(p.multiplier) * np.float32(p.base) ** np.float32(exp))
    return out


def top_slots(penalties: dict[int, float], slots: int = DRY_SLOTS) -> list[tuple[int, float]]:
    """The `slots` largest penalties (ties by token id), the ones the sampler's fixed width keeps."""
    return sorted(penalties.items(), key=lambda kv: (-kv[1], kv[0]))[:slots]


class BreakerTable:
    """Breaker strings -> token sequences for one tokenizer. The vocabulary's texts are decoded once, joined
    into one NUL-separated string ("contains": one C-level regex pass) and sorted reversed ("ends with a
    prefix": a bisection per prefix), so no breaker loops over the vocabulary in Python; each tail is
    tokenised once; merged sets are kept by content in an LRU of BREAKER_CACHE entries."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._texts: list[str] | None = None
        self._joined = ""
        self._nul_tokens: set[int] = set()
        self._reversed: list[str] = []        # every text reversed, sorted: "ends with" is a prefix range
        self._reversed_ids: list[int] = []
        self._starts = np.zeros(0, np.int64)   # where each token's text begins in _joined
        self._sets: OrderedDict[tuple[str, ...], Breakers] = OrderedDict()
        self._one_cache: OrderedDict[str, Breakers] = OrderedDict()

    def breakers(self, strings: Sequence[str]) -> Breakers:
        """The merged head -> tails map of `strings` (shared: callers must not mutate it)."""
        key = tuple(strings)
        if key in self._sets:
            self._sets.move_to_end(key)
            return self._sets[key]
        out: Breakers = {}
        for s in key:
            for head, tails in self._one(s[:MAX_BREAKER_CHARS]).items():
                merged = out.setdefault(head, [])
                merged.extend(t for t in tails if t not in merged)
        self._sets[key] = out
        if len(self._sets) > BREAKER_CACHE:
            self._sets.popitem(last=False)
        return out

    def _one(self, s: str) -> Breakers:
        if s in self._one_cache:
            self._one_cache.move_to_end(s)
            return self._one_cache[s]
        out = self._scan(s) if s else {}
        self._one_cache[s] = out
        if len(self._one_cache) > BREAKER_CACHE * MAX_BREAKERS:
            self._one_cache.popitem(last=False)
        return out

    def _scan(self, s: str) -> Breakers:
        """llama.cpp's overlap scan for one string: tokens containing it, and tokens ending in a proper
        prefix of it (the head of a multi-token breaker, with the rest's tokenisation as the tail)."""
        texts = self._vocab_texts()
        if "\0" in s:   # the separator: the plain scan (a breaker holding NUL is rare)
            return _scan_plain(s, enumerate(texts), self._encode)
        contains = self._tokens_at(s)
        # texts holding NUL (rare) cannot be searched joined: they take the plain scan
        out: Breakers = _scan_plain(s, ((t, texts[t]) for t in self._nul_tokens), self._encode)
        contains |= {tok for tok, tails in out.items() if tails == [()]}
        out.update({tok: [()] for tok in contains})
        for rest in range(len(s) - 1, 0, -1):   # longer prefixes first: llama.cpp's order of tails
            heads = [tok for tok in self._tokens_ending(s[:rest]) if tok not in contains]
            if not heads:
                continue
            tail = self._encode(s[rest:])
            for tok in heads:
                tails = out.setdefault(tok, [])
                if tail not in tails:
                    tails.append(tail)
        return out

    def _tokens_at(self, needle: str) -> set[int]:
        """Token ids whose text contains `needle` (one regex pass over the joined texts)."""
        hits = np.fromiter((m.start() for m in regex.finditer(regex.escape(needle), self._joined)), np.int64)
        return set((np.searchsorted(self._starts, hits, side="right") - 1).tolist()) - self._nul_tokens

    def _tokens_ending(self, suffix: str) -> list[int]:
        """Token ids whose text ends with `suffix`: a range of the sorted reversed texts (two bisections)."""
        key = suffix[::-1]
        lo = bisect.bisect_left(self._reversed, key)
        hi = lo
        while hi < len(self._reversed) and self._reversed[hi].startswith(key):
            hi += 1
        return self._reversed_ids[lo:hi]

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(self._tokenizer.encode(text, add_special_tokens=False, parse_special=False)[:MAX_BREAKER_TAIL])

    def _vocab_texts(self) -> list[str]:
        if self._texts is None:
            ids = [[i] for i in range(self._vocab_size)]
            backend = getattr(self._tokenizer, "backend", None)
            self._texts = (backend.decode_batch(ids, skip_special_tokens=False) if backend is not None
                           else [self._tokenizer.decode(i, skip_special_tokens=False) for i in ids])
            # "\0" before and after every text: token i's text is _joined[_starts[i]:_starts[i] + len]
            lengths = np.fromiter((len(t) + 1 for t in self._texts), np.int64, len(self._texts))
            self._starts = np.concatenate([[1], 1 + np.cumsum(lengths)[:-1]])
            self._joined = "\0" + "\0".join(self._texts) + "\0"
            self._nul_tokens = {i for i, t in enumerate(self._texts) if "\0" in t}
            order = sorted(range(len(self._texts)), key=lambda i: self._texts[i][::-1])
            self._reversed = [self._texts[i][::-1] for i in order]
            self._reversed_ids = order
        return self._texts


def _scan_plain(s: str, texts: Iterable[tuple[int, str]], encode: Any) -> Breakers:
    """The per-token scan (llama.cpp's loop) over (token id, text) pairs, where the joined text cannot serve."""
    out: Breakers = {}
    for tok, word in texts:
        if s in word:
            out[tok] = [()]
            continue
        for pos in range(max(0, len(word) - len(s) + 1), len(word)):
            rest = len(word) - pos
            if word[pos:] == s[:rest]:
                tail = encode(s[rest:])
                if tail not in out.setdefault(tok, []):
                    out[tok].append(tail)
    return out
