"""Prefill chunks cut to the compiled step sizes (runtime/scheduling/scheduler.py `Scheduler._chunk`): a step is
padded to the next size a step program was compiled for, so when a prompt would carry the step just past a size,
the scheduler ends this step's chunk at that size and runs the rest next step, as long as that defers fewer
tokens than the padding would have cost; never into an atomic span. And drafts only in steps of at most
--speculative-max-batch decoding sequences. Sequences are bare (no detokenizer)."""
from __future__ import annotations

import random

import pytest

from imp_jax.runtime.config import EngineConfig
from imp_jax.runtime.execution.step import step_buckets
from imp_jax.runtime.kv.kv_blocks import KVBlockPool
from imp_jax.runtime.request import GenerationRequest, SamplingParams
from imp_jax.runtime.scheduling.scheduler import ScheduledChunk, Scheduler
from imp_jax.runtime.scheduling.sequence import Sequence

SIZES = sorted({t for t, _ in step_buckets(512, 32)})   # the engine's default: 1, 2, 4, 8, 16, ..., 512


def _seq(n: int, spans: tuple[tuple[int, int], ...] = ()) -> Sequence:
    prompt = [random.randrange(10, 1000) for _ in range(n)]
    seq = Sequence(request=GenerationRequest(f"r-{random.random()}", prompt), index=0, params=SamplingParams(),
                   max_tokens=64, detok=None, stops=None, prompt_ids=prompt, arrival=0.0)
    if spans:
        seq.ext["atomic_spans"] = spans
    return seq


def _run(s: Scheduler, chunks: list[ScheduledChunk]) -> None:
    """The engine's part of a step: the chunks' KV is written, each finished prompt gets a token."""
    for c in chunks:
        c.seq.num_computed += c.num_tokens
        if c.seq.num_computed == c.seq.num_tokens:
            c.seq.output_ids.append(3)


def _decoding(s: Scheduler, rows: int) -> None:
    """`rows` sequences past their prompts, each decoding one token a step."""
    for _ in range(rows):
        s.add(_seq(8))
    _run(s, s.schedule())
    assert all(not q.is_prefill for q in s.running) and len(s.running) == rows


def _scheduler(sizes: list[int]) -> Scheduler:
    s = Scheduler(KVBlockPool(512, 16), max_num_seqs=32, max_num_batched_tokens=512)
    s.step_sizes = sizes
    return s


def test_a_prompt_just_past_a_step_size_runs_up_to_it_and_the_rest_next_step() -> None:
    s = _scheduler(SIZES)
    _decoding(s, 8)
    s.add(prompt := _seq(128))
    first = s.schedule()
    assert sum(c.num_tokens for c in first) == 128   # 8 decodes and 120 of the prompt, not 136 padded to 256
    assert [c.num_tokens for c in first if c.seq is prompt] == [120]
    _run(s, first)
    second = s.schedule()
    assert [c.num_tokens for c in second if c.seq is prompt] == [8] and sum(c.num_tokens for c in second) == 16


def test_no_step_sizes_or_more_deferred_than_padded_leaves_the_chunk_whole() -> None:
    s = _scheduler([])   # a scheduler on its own: no compiled sizes known
    _decoding(s, 8)
    s.add(prompt := _seq(128))
    assert [c.num_tokens for c in s.schedule() if c.seq is prompt] == [128]
    s = _scheduler(SIZES)
    _decoding(s, 8)
    s.add(prompt := _seq(200))   # 208: 80 past 128, 48 short of 256: padding is the cheaper
    assert [c.num_tokens for c in s.schedule() if c.seq is prompt] == [200]
    s = _scheduler(SIZES)
    s.add(prompt := _seq(512))   # exactly a size: nothing to cut
    assert [c.num_tokens for c in s.schedule() if c.seq is prompt] == [512]


def test_a_cut_never_ends_inside_an_atomic_span() -> None:
    s = _scheduler(SIZES)
    _decoding(s, 8)
    s.add(prompt := _seq(128, spans=((100, 125),)))   # cutting at 120 would split the span: whole
    assert [c.num_tokens for c in s.schedule() if c.seq is prompt] == [128]


def test_drafts_only_in_steps_of_at_most_max_draft_batch_decoding_sequences() -> None:
    """--speculative-max-batch: a step of more decoding sequences than the limit drafts nothing (its verify rows
    would cost more than they save); at the limit, or with no limit (0), every decode gets its drafts."""
    for limit, rows, drafted in ((2, 3, False), (2, 2, True), (0, 3, True)):
        s = _scheduler([])
        s.drafter = lambda seq, room: [5, 6]
        s.max_draft_batch = limit
        _decoding(s, rows)
        chunks = s.schedule()
        assert len(chunks) == rows
        assert all(c.drafts == ((5, 6) if drafted else ()) for c in chunks), (limit, rows)


def test_the_engine_flag_sets_the_limit_and_refuses_a_negative_one() -> None:
    assert EngineConfig().speculative_max_batch == 2
    with pytest.raises(ValueError, match="--speculative-max-batch must be 0 or more, got -1"):
        EngineConfig(speculative_max_batch=-1)
