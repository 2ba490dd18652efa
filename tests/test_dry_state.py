"""DRY's incremental state (runtime/decoding/dry.py DryState) gives exactly `repeat_penalties` (kept as the
reference) after every accepted token and every rewind, over random histories, breakers, allowed
lengths and penalty_last_n windows; its work per token does not grow with the history; the breaker
table's joined-text scan equals llama.cpp's per-token loop and is cached by content."""
from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from imp_jax.runtime.decoding.dry import BreakerTable, DryParams, DryState, _scan_plain, repeat_penalties

BREAKER_SETS = [{}, {3: [()]}, {2: [(3,)]}, {0: [(1, 1)], 3: [()]}, {1: [(), (2,)], 2: [(0, 0), (0,)]}]

# one action: ("feed", token) or ("cut", how many output tokens to drop)
actions = st.lists(st.one_of(st.tuples(st.just("feed"), st.integers(0, 4)),
                             st.tuples(st.just("cut"), st.integers(1, 6))), max_size=60)


@settings(max_examples=300, deadline=None)
@given(prompt=st.lists(st.integers(0, 4), max_size=30), steps=actions, breakers=st.sampled_from(BREAKER_SETS),
       allowed=st.integers(0, 5), last_n=st.one_of(st.just(-1), st.integers(0, 25)),
       context=st.integers(1, 40), base=st.sampled_from([1.0, 1.75, 3.0, 10.0]))
def test_state_equals_the_full_scan_after_every_token_and_rewind(prompt, steps, breakers, allowed, last_n,
                                                                 context, base) -> None:
    p = DryParams(multiplier=0.8, base=base, allowed_length=allowed, penalty_last_n=last_n)
    state = DryState(p, breakers, context)
    output: list[int] = []
    assert state.penalties(prompt, output) == repeat_penalties(prompt, p, breakers, context)
    for kind, value in steps:
        if kind == "feed":
            output.append(value)
        else:
            del output[max(0, len(output) - value):]
        assert state.penalties(prompt, output) == repeat_penalties(prompt + output, p, breakers, context)


def test_a_changed_history_of_the_same_length_is_rebuilt() -> None:
    p = DryParams(multiplier=1.0, allowed_length=1)
    state = DryState(p, {}, 100)
    assert state.penalties([1, 2, 1], []) == repeat_penalties([1, 2, 1], p, {}, 100)
    assert state.penalties([1, 2, 3], []) == repeat_penalties([1, 2, 3], p, {}, 100) == {}


def test_work_per_token_does_not_grow_with_the_history() -> None:
    """A 32k-token history of prose-like random tokens: the last 100 tokens cost about what the
    first 100 did (the full scan grows linearly)."""
    import random
    rng = random.Random(0)
    history = [rng.randrange(2000) for _ in range(32_000)]
    p = DryParams(multiplier=0.8)
    state = DryState(p, {5: [()]}, 32_768)

    def cost(lo: int, hi: int) -> float:
        t0 = time.perf_counter()
        for n in range(lo, hi):
            state.penalties(history[:0], history[:n])  # noqa: E203 - a growing output list view
        return time.perf_counter() - t0

    early = cost(1, 200)
    state2 = DryState(p, {5: [()]}, 32_768)
    state2.sync([], history[:31_800])
    state = state2
    late = cost(31_800, 32_000)
    assert late < 5 * early + 0.05, (early, late)


class _Tok:
    """Characters plus a few words, one of them holding NUL."""
    vocab = ("a", "b", "\n", "x\n", "ab:", "q:", ":", "z", "", "b\n\n", "\0", "a\0b", "q", "x")

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.vocab[i] for i in ids)

    def encode(self, text, add_special_tokens=True, parse_special=True):
        out, i = [], 0
        while i < len(text):   # greedy longest match over the vocabulary
            tok = max((t for t, w in enumerate(self.vocab) if w and text.startswith(w, i)),
                      key=lambda t: len(self.vocab[t]))
            out.append(tok)
            i += len(self.vocab[tok])
        return out


def _as_sets(b: dict) -> dict:
    return {head: set(tails) for head, tails in b.items()}


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="ab\n:qxz\0", min_size=1, max_size=8))
def test_joined_scan_equals_the_per_token_loop(s) -> None:
    tok = _Tok()
    table = BreakerTable(tok, len(tok.vocab))
    plain = _scan_plain(s, enumerate(tok.vocab), table._encode)
    assert _as_sets(table.breakers([s])) == _as_sets(plain)


def test_breaker_sets_are_cached_by_content_and_bounded() -> None:
    table = BreakerTable(_Tok(), len(_Tok.vocab))
    first = table.breakers(["\n", "b:"])
    assert table.breakers(("\n", "b:")) is first
    for i in range(200):
        table.breakers(["a" * (i % 7 + 1), str(i)])
    assert len(table._sets) <= 64 and len(table._one_cache) <= 64 * 16
    assert table.breakers(["\n", "b:"]) == first and table.breakers(["\n", "b:"]) is not first
