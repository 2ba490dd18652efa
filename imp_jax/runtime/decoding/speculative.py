"""Speculative decoding: n-gram (prompt-lookup) drafting, the acceptance rule and per-sequence depth.

A decoding sequence whose recent tokens occurred before (in its prompt or its output) proposes
the tokens that followed them there; the scheduler gives it a chunk of its last token plus those
drafts, and the step samples every row of the chunk (runtime/execution/step.py). Row j's token is what plain
decoding would sample after the drafts before j, so the drafts are accepted while each equals the
token sampled at its row, and the first row that differs (or the row after the last draft) gives
the next token. For a greedy row that is the argmax. For a sampled row it is the speculative-
sampling rule for a deterministic draft d: d is accepted with probability p(d), and on rejection
the token is drawn from p with d removed, renormalised; a draw x ~ p that is kept when x == d and
emitted otherwise does exactly that, so the output distribution is the plain one (with a seed,
token for token: a seeded row's key is its position). Rejected drafts' KV is dropped with
KVBlockPool.truncate.

Host-side NumPy; a sequence with no match drafts nothing and decodes as a plain row.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


MAX_DRAFT = 16            # the largest draft depth a request may ask for (ngram_k, mtp_k)
DEFAULT_MAX_DRAFT = 7     # --speculative-max-draft: a batch-1 verify chunk of 8 tokens (one bucket)
NGRAM_SIZES = (3, 2)   # suffix lengths tried, longest first
MAX_BACKOFF = 64          # plain steps a sequence waits at most before drafting again after misses


def ngram_draft(ids: Sequence[int] | np.ndarray, k: int, sizes: Sequence[int] = NGRAM_SIZES) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix of
    `ids` (of the lengths in `sizes`) that occurred before; [] when none did."""
    if k <= 0:
        return []
    arr = np.asarray(ids, np.int64)
    n_ids = len(arr)
    for n in sizes:
        if n_ids <= n:
            continue
        windows = sliding_window_view(arr[:n_ids - 1], n)   # every n-gram with a token after it
        hits = np.flatnonzero((windows == arr[n_ids - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start:start + k].tolist()
    return []


def accepted_prefix(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many drafts are accepted: the leading ones equal to the token sampled at their row
    (`sampled` has one more entry than `drafts`: row j's token follows draft j - 1)."""
    a = 0
    while a < len(drafts) and int(sampled[a]) == int(drafts[a]):
        a += 1
    return a


@dataclasses.dataclass
class SpecState:
    """One sequence's drafting depth and counters. The depth adapts to what is accepted: a fully
    accepted draft doubles it (up to `max_k`), a partial one sets it to one past what was
    accepted, and a miss (nothing accepted) turns drafting off for a backoff of plain steps that
    doubles with each consecutive miss, so text that does not repeat costs almost nothing."""

    max_k: int
    k: int = 2
    backoff: int = 0          # plain decode steps left before drafting again
    misses: int = 0           # consecutive verify steps that accepted nothing
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    verify_steps: int = 0
    miss_steps: int = 0

    def __post_init__(self) -> None:
        self.k = min(self.k, self.max_k)

    def depth(self) -> int:
        """Tokens to draft now (0: decode plainly, during a backoff)."""
        return 0 if self.max_k <= 0 or self.backoff > 0 else self.k

    def plain_step(self) -> None:
        """A plain decode step of the sequence was read: one step less of backoff."""
        if self.backoff > 0:
            self.backoff -= 1

    def record(self, drafted: int, accepted: int) -> None:
        """A verify step's outcome: `accepted` of `drafted` drafts, plus the token after them."""
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += accepted + 1
        self.verify_steps += 1
        if accepted == 0:
            self.miss_steps += 1
            self.misses += 1
            self.backoff = min(MAX_BACKOFF, 2 ** (self.misses + 1))
            self.k = 1
            return
        self.misses = 0
        self.k = min(self.max_k, 2 * drafted if accepted == drafted else accepted + 1)

    def usage(self) -> dict[str, int]:
        """The usage counters (usage.completion_tokens_details.imp_spec_*)."""
        return {"imp_spec_drafted": self.drafted, "imp_spec_accepted": self.accepted,
                "imp_spec_emitted": self.emitted, "imp_spec_verify_steps": self.verify_steps}
