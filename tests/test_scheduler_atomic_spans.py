"""Atomic spans in the scheduler (a bidirectional model's images: runtime/scheduling/scheduler.py, Sequence.chunk_fit): a
prefill chunk never ends strictly inside one, may start inside one (prefix-cache hits) when it runs to its end,
and a sequence held back by a span that does not fit the step's remaining budget runs first next step instead of
starving behind decodes. Sequences are bare (no detokenizer): the scheduler reads only their tokens, tables,
request and `ext`."""
from __future__ import annotations

import random

from imp_jax.runtime.kv.kv_blocks import KVBlockPool
from imp_jax.runtime.request import GenerationRequest, SamplingParams
from imp_jax.runtime.scheduling.scheduler import ScheduledChunk, Scheduler
from imp_jax.runtime.scheduling.sequence import Sequence, SeqStatus


def _seq(prompt: list[int], spans: tuple[tuple[int, int], ...], arrival: float = 0.0) -> Sequence:
    req = GenerationRequest(f"r-{random.random()}", prompt)
    seq = Sequence(request=req, index=0, params=SamplingParams(), max_tokens=8, detok=None, stops=None,
                   prompt_ids=list(prompt), arrival=arrival)
    if spans:
        seq.ext["atomic_spans"] = spans
    return seq


def _advance(s: Scheduler, chunks: list[ScheduledChunk]) -> None:
    """What the engine does after a step: the chunks' KV counts as written (full blocks join the prefix
    cache) and each sampling chunk's sequence gets a token; one at max_tokens ends."""
    for c in chunks:
        seq = c.seq
        seq.num_computed += c.num_tokens
        s.pool.commit(seq.table, seq.all_ids[:seq.num_computed], seq.cache_key)
        if seq.num_computed == seq.num_tokens:
            seq.output_ids.append(3)
            if len(seq.output_ids) == seq.max_tokens:
                s.remove(seq)


def _assert_outside_spans(chunks: list[ScheduledChunk]) -> None:
    for c in chunks:
        a, b = c.seq.num_computed, c.seq.num_computed + c.num_tokens
        for lo, hi in c.seq.ext.get("atomic_spans", ()):
            assert not lo < b < hi, f"chunk [{a}, {b}) ends inside span [{lo}, {hi})"


def test_chunk_fit_cuts_back_to_the_span_start() -> None:
    seq = _seq(list(range(100)), ((10, 30), (40, 41), (50, 90)))
    assert seq.chunk_fit(0, 20) == 10            # would end inside [10, 30)
    assert seq.chunk_fit(0, 30) == 30            # ends at its end
    assert seq.chunk_fit(12, 18) == 18           # starts inside, runs to its end
    assert seq.chunk_fit(12, 10) == 0            # starts inside, stops short: nothing fits
    assert seq.chunk_fit(30, 11) == 11           # a one-token span never holds an end inside
    assert seq.chunk_fit(30, 30) == 20           # cut to 50
    assert seq.chunk_fit(50, 30) == 0
    assert _seq(list(range(100)), ()).chunk_fit(0, 37) == 37


def test_a_held_prefill_runs_first_next_step_despite_decodes() -> None:
    """A budget of 16 with 12 decodes running: the prefill's 10-token span never fits what they leave, so it
    is held one step and then runs first, the decodes that do not fit waiting a step."""
    s = Scheduler(KVBlockPool(256, 4), max_num_seqs=16, max_num_batched_tokens=16)
    decodes = [_seq([1, 2], (), arrival=float(i)) for i in range(12)]
    for d in decodes:
        d.max_tokens = 100
        s.add(d)
    _advance(s, s.schedule())                    # every decode's prompt: 24 tokens over two steps
    _advance(s, s.schedule())
    assert all(not d.is_prefill for d in decodes)
    image = _seq([5] * 4 + [9] * 10 + [6] * 4, ((4, 14),), arrival=100.0)
    s.add(image)
    first = s.schedule()                         # 12 decodes, then the 4 tokens before the span
    assert [c.num_tokens for c in first if c.seq is image] == [4] and len(first) == 13
    _advance(s, first)
    second = s.schedule()                        # 12 decodes leave 4: the span does not fit, it is held
    assert image not in [c.seq for c in second] and s.held == [image]
    _advance(s, second)
    third = s.schedule()
    assert third[0].seq is image and third[0].num_tokens == 14    # the span and the tail, first
    assert len(third) == 3 and not s.held                          # two decodes in what is left
    _assert_outside_spans(third)


def test_a_chunk_starting_inside_a_span_on_a_prefix_hit_runs_to_its_end() -> None:
    """The second of two equal prompts hits the first's blocks up to a block edge inside the span: its
    first chunk starts there and must reach the span's end, so with a budget short of that it waits."""
    prompt = list(range(1, 7)) + [9] * 14 + list(range(30, 40))    # span [6, 20), blocks of 4
    s = Scheduler(KVBlockPool(64, 4), max_num_seqs=4, max_num_batched_tokens=32)
    one = _seq(prompt, ((6, 20),))
    s.add(one)
    _advance(s, s.schedule())
    two = _seq(prompt, ((6, 20),))
    s.max_num_batched_tokens = 6                 # the hit ends at 28 (7 blocks): 2 tokens from the end
    s.add(two)
    chunks = s.schedule()
    assert [(c.seq, c.seq.num_computed, c.num_tokens) for c in chunks if c.seq is two] == [(two, 28, 2)]
    three = _seq(prompt[:18] + [77] * 12, ((6, 20),))   # shares 16 tokens (4 blocks): a hit inside the span
    s.max_num_batched_tokens = 3
    s.add(three)
    _advance(s, chunks)
    assert three not in [c.seq for c in s.schedule()] and three in s.held   # 16 + 3 ends inside it
    s.max_num_batched_tokens = 8
    chunk = next(c for c in s.schedule() if c.seq is three)
    assert (three.num_computed, chunk.num_tokens) == (16, 8)    # from inside the span, past its end


def test_random_workloads_never_end_a_chunk_inside_a_span_and_finish() -> None:
    """A simulator: prompts with spans up to the budget, shared prefixes (hits inside spans), blocks for a
    few sequences (preemption and recompute), decodes. Every chunk respects the spans; everyone finishes."""
    rng = random.Random(0)
    for trial in range(40):
        budget = rng.choice([8, 16, 24])
        s = Scheduler(KVBlockPool(rng.choice([24, 64]), 4), max_num_seqs=rng.choice([2, 4, 8]),
                      max_num_batched_tokens=budget)
        base = [rng.randrange(1, 50) for _ in range(60)]
        seqs = []
        for i in range(rng.randrange(2, 9)):
            n = rng.randrange(4, 60)
            prompt = base[:n] if rng.random() < 0.5 else [rng.randrange(1, 50) for _ in range(n)]
            spans, p = [], rng.randrange(0, 4)
            while p < n - 1:
                hi = min(n, p + rng.randrange(1, budget + 1))
                spans.append((p, hi))
                p = hi + rng.randrange(0, 6)
            seq = _seq(prompt, tuple(spans), arrival=float(i))
            seq.max_tokens = rng.randrange(1, 6)
            seqs.append(seq)
            s.add(seq)
        for _ in range(400):
            if not s.has_work():
                break
            chunks = s.schedule()
            _assert_outside_spans(chunks)
            assert sum(c.num_tokens for c in chunks) <= budget
            _advance(s, chunks)
        assert all(q.status is SeqStatus.FINISHED for q in seqs), f"trial {trial}: a sequence starved"
