"""EngineCore and AsyncEngine end to end on the real SmolLM2, on CPU.

Engines are built once per session, on the session's shared SmolLM2 load: a token budget of
16 keeps the step buckets to five ((16, 8) and the decode diagonal 1, 2, 4, 8) and forces chunked
prefill on every prompt
(20-90 tokens). The tiny-pool engine has the KV shape of the big one, so its step programs are
the same and come from the persistent compilation cache; only its block pool is small.
"""
from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from pathlib import Path
from typing import Callable

import jax.numpy as jnp
import numpy as np
import pytest
from support.engine import BIG_POOL_BLOCKS, MAX_MODEL_LEN, TOKEN_BUDGET, Result, make_engine, req, run

from imp_jax.errors import InvalidRequestError
from imp_jax.kernels_pallas import kv_storage_dtype
from imp_jax.runtime.core.async_engine import AsyncEngine
from imp_jax.runtime.core.builder import enable_compilation_cache
from imp_jax.runtime.config import EngineConfig
from imp_jax.runtime.core.engine import EngineCore
from imp_jax.runtime.request import GenerationRequest, SamplingParams

pytestmark = pytest.mark.real_model

MAX_TOKENS = 6
PROMPT_LENGTHS = (20, 27, 33, 41, 50, 61, 75, 90)
TINY_POOL_BLOCKS = 9      # 8 usable blocks: 128 tokens
SEEDED = dict(temperature=0.8, seed=1234, max_tokens=MAX_TOKENS)
PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps "
    "as his father had taught him. Below, the harbour filled with fishing boats returning from "
    "the grey northern sea, their decks heavy with nets and their crews singing old songs. "
    "In the village, the baker was already preparing the dough for the morning bread, while the "
    "schoolteacher graded essays about the history of the railway that had reached the coast "
    "a century ago. Nobody remembered exactly when the first lamp was lit, but everyone agreed "
    "that the light had never failed, not even during the great storm that flooded the lower "
    "streets and carried away the old wooden pier. Scientists who visited the island measured "
    "the tides, collected samples of seaweed, and wrote long reports about the migrating birds "
    "that rested on the cliffs each autumn before crossing the ocean to warmer lands."
)


def step_until(core: EngineCore, cond: Callable[[], bool], max_steps: int = 50) -> None:
    for _ in range(max_steps):
        if cond():
            return
        core.step()
    pytest.fail("condition not reached")


def spanning_stop(tok, ids: list[int]) -> tuple[str, int, str] | None:
    """A stop string of the last 2 chars of token k-1's text and the first 2 of token k's,
    occurring first there: (stop, k, text before the stop)."""
    full = tok.decode(ids)
    for k in range(1, len(ids)):
        before, after = tok.decode(ids[:k]), tok.decode(ids[:k + 1])
        right = after[len(before):]
        if not after.startswith(before) or len(before) < 2 or len(right) < 2:
            continue
        stop = before[-2:] + right[:2]
        if full.find(stop) == len(before) - 2:
            return stop, k, before[:-2]
    return None


@pytest.fixture(scope="module")
def core(smollm2_loaded, smollm2_gguf_path: Path) -> EngineCore:
    # asynchronous scheduling asked for: a CPU's default (auto) is off, and these tests pin the overlapped path
    config = EngineConfig(model=str(smollm2_gguf_path), max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                          max_num_batched_tokens=TOKEN_BUDGET, num_kv_blocks=BIG_POOL_BLOCKS, async_scheduling="on")
    enable_compilation_cache(config)
    return make_engine(smollm2_loaded, config, BIG_POOL_BLOCKS)


@pytest.fixture(scope="module")
def tiny_core(core: EngineCore) -> EngineCore:
    config = dataclasses.replace(core.config, num_kv_blocks=TINY_POOL_BLOCKS)
    return make_engine(core.loaded, config, TINY_POOL_BLOCKS)


@pytest.fixture(scope="module")
def tok(core: EngineCore):
    return core.tokenizer


@pytest.fixture(scope="module")
def prompts(tok) -> list[list[int]]:
    ids = tok.encode(PASSAGE)
    assert len(ids) >= 9 * 7 + PROMPT_LENGTHS[-1]
    return [ids[9 * i:9 * i + n] for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="module")
def greedy_alone(core: EngineCore, prompts) -> list[Result]:
    """Each prompt on its own, greedy: the reference for batching, preemption and caching."""
    return [run(core, req(p, max_tokens=MAX_TOKENS))[0] for p in prompts]


@pytest.fixture(scope="module")
def seeded_alone(core: EngineCore, prompts) -> Result:
    return run(core, req(prompts[1], **SEEDED))[0]


@pytest.fixture(scope="module")
def mixed(core: EngineCore, tok, prompts, greedy_alone) -> dict[str, Result]:
    """One batch mixing lengths, n, sampling knobs, logprobs, penalties, bias and stops."""
    stop, _, _ = spanning_stop(tok, greedy_alone[6].ids) or pytest.fail("no spanning stop string")
    banned = greedy_alone[5].ids[0]
    reqs = {
        "seeded": req(prompts[1], **SEEDED),
        "n4": req(prompts[3], n=4, temperature=1.0, seed=7, max_tokens=MAX_TOKENS),
        "logprobs": req(prompts[0], logprobs=5, max_tokens=MAX_TOKENS),
        "knobs": req(prompts[5], temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, typical_p=0.95,
                     presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                     logit_bias={banned: -100.0, 11: 2.0}, logprobs=2, max_tokens=MAX_TOKENS),
        "length": req(prompts[2], ignore_eos=True, max_tokens=4),
        "stop_str": req(prompts[6], stop=[stop], max_tokens=MAX_TOKENS),
        "stop_str_incl": req(prompts[6], stop=[stop], include_stop_str_in_output=True,
                             max_tokens=MAX_TOKENS),
    }
    return dict(zip(reqs, run(core, *reqs.values())))


# ------------------------------------------------------------------- batching and caching
def test_greedy_outputs_are_batch_invariant_under_chunked_prefill(core, prompts, greedy_alone, tok):
    assert min(map(len, prompts)) > TOKEN_BUDGET       # every prompt is prefilled in chunks
    for g in greedy_alone:
        assert len(g.ids) == MAX_TOKENS or g.first.finish_reason == "stop"
        assert g.first.text == tok.decode(g.ids)
    core.pool.reset_prefix_cache()                      # compute every prompt afresh, together
    together = run(core, *(req(p, max_tokens=MAX_TOKENS) for p in prompts))
    assert [r.ids for r in together] == [g.ids for g in greedy_alone]
    assert [r.usage.cached_tokens for r in together] == [0] * len(prompts)


def test_seeded_sampling_ignores_its_neighbours(mixed, seeded_alone):
    assert mixed["seeded"].ids == seeded_alone.ids
    assert len(seeded_alone.ids) == MAX_TOKENS


def test_prefix_reuse_reports_cached_tokens_and_same_output(core, prompts, greedy_alone):
    core.pool.reset_prefix_cache()
    shared = prompts[7][:70]
    first = req(shared + prompts[0][:10], cache_prompt=True, max_tokens=2)
    res = Result()
    queries = core.pool.stats().queries
    core.add_request(first, res.on_event)
    seq = core.requests[first.request_id].seqs[0]
    step_until(core, lambda: seq.pinned)                # prompt done: its blocks are pinned
    assert core.pool.num_free_blocks < core.baseline_free_blocks
    step_until(core, lambda: not core.has_work())
    assert res.usage.cached_tokens == 0
    assert core.pool.stats().queries - queries == len(first.prompt_ids)   # one lookup per admission
    assert core.pool.num_free_blocks == core.baseline_free_blocks   # pins released at the end

    second = run(core, req(prompts[7], max_tokens=MAX_TOKENS))[0]
    assert second.usage.cached_tokens == 64             # the 4 full blocks of the shared 70 tokens
    assert second.ids == greedy_alone[7].ids and greedy_alone[7].usage.cached_tokens == 0
    assert core.stats()["prefix_cache_hits"] >= 64


def test_forced_hash_collision_never_serves_another_prompts_kv(core, prompts, greedy_alone, monkeypatch):
    """Every block hashes alike: a different prompt must miss (tokens are verified), and answer as alone."""
    import imp_jax.runtime.kv.kv_blocks as kv_blocks

    core.pool.reset_prefix_cache()
    monkeypatch.setattr(kv_blocks, "hash_block", lambda preimage: b"\x00" * 32)
    collisions = core.pool.stats().collisions
    try:
        first = run(core, req(prompts[6], max_tokens=MAX_TOKENS))[0]
        second = run(core, req(prompts[7], max_tokens=MAX_TOKENS))[0]
    finally:
        core.pool.reset_prefix_cache()
    assert first.ids == greedy_alone[6].ids
    assert second.usage.cached_tokens == 0 and second.ids == greedy_alone[7].ids
    assert core.pool.stats().collisions > collisions
    assert core.pool.num_free_blocks == core.baseline_free_blocks


def test_preemption_recomputes_to_the_same_output(core, tiny_core, tok, seeded_alone, prompts):
    # prompts of 16k-1 tokens cross into a new block at their second decode step; their
    # 10 blocks do not fit in 8, so decodes must preempt
    ids = tok.encode(PASSAGE)
    workload = [ids[:31], ids[40:71], ids[80:127], ids[110:157]]

    def requests() -> list[GenerationRequest]:
        return [*(req(p, max_tokens=8) for p in workload), req(prompts[1], **{**SEEDED, "max_tokens": 8})]

    big = run(core, *requests())
    before = tiny_core.scheduler.num_preemptions
    small = run(tiny_core, *requests())
    assert tiny_core.scheduler.num_preemptions > before
    assert [r.ids for r in small] == [r.ids for r in big]
    assert [r.first.text for r in small] == [r.first.text for r in big]
    assert big[-1].ids[:MAX_TOKENS] == seeded_alone.ids   # seeded: position-keyed, whatever the length


def test_sequence_outgrowing_the_pool_finishes_with_length(tiny_core, tok):
    capacity = (TINY_POOL_BLOCKS - 1) * tiny_core.config.block_size
    prompt = (tok.encode(PASSAGE) * 2)[:capacity - 3]
    rejections = tiny_core.stats()["kv_pressure_rejections"]
    res = run(tiny_core, req(prompt, max_tokens=50, ignore_eos=True))[0]
    assert res.first.finish_reason == "length"
    assert len(prompt) + len(res.ids) == capacity + 1   # the last token needs no KV
    assert tiny_core.stats()["kv_pressure_rejections"] == rejections + 1


def test_waiting_requests_are_admitted_by_priority_lower_first(core, prompts):
    """With one sequence slot, three requests queued together run one after another, lowest `priority`
    first (then shortest prompt, then arrival), whatever order they came in."""
    order: list[str] = []
    slots = core.scheduler.max_num_seqs
    core.scheduler.max_num_seqs = 1   # the policy's knob; the compiled programs take fewer rows as they are
    try:
        reqs = []
        for name, priority in (("late", 5), ("normal", 0), ("urgent", -2)):
            r = req(prompts[0], max_tokens=2, ignore_eos=True)
            r.request_id, r.priority = name, priority
            reqs.append(r)
        results = [Result() for _ in reqs]
        for r, res in zip(reqs, results):
            def on_event(ev, res=res, name=r.request_id) -> None:
                if ev.token_ids and name not in order:
                    order.append(name)
                res.on_event(ev)
            core.add_request(r, on_event)
        step_until(core, lambda: not core.has_work(), max_steps=200)
    finally:
        core.scheduler.max_num_seqs = slots
    assert order == ["urgent", "normal", "late"]
    assert all(res.usage.completion_tokens == 2 for res in results)
    assert core.pool.num_free_blocks == core.baseline_free_blocks


def test_stats_count_decode_batches_and_read_zero_when_idle(core, prompts):
    before = core.stats()
    results = run(core, *(req(p, max_tokens=MAX_TOKENS) for p in prompts[:3]))
    after = core.stats()
    steps = after["decode_batch_steps_total"] - before["decode_batch_steps_total"]
    rows = after["decode_batch_rows_total"] - before["decode_batch_rows_total"]
    # every token after a choice's first is sampled by a decode row (the first ends a prefill, which
    # is a one-token row when the prompt's last chunk is a single token)
    assert sum(len(r.ids) - 1 for r in results) <= rows <= sum(len(r.ids) for r in results)
    assert 0 < steps <= rows and 1 <= after["decode_batch_max"] <= core.config.max_num_seqs
    assert after["decode_batch_last_rows"] == 0 and after["kv_blocks_reserved"] == 0   # idle
    assert after["kv_blocks_used"] == 0 and after["kv_blocks_total"] == core.baseline_free_blocks
    assert all(ev.admitted_at is not None and ev.admitted_at <= ev.created_at for r in results for ev in r.events)


# ----------------------------------------------------------------------------- cancellation
def test_cancel_mid_generation_frees_blocks_and_pins(core, prompts):
    a = req(prompts[2], cache_prompt=True, max_tokens=100)
    b = req(prompts[0], max_tokens=4)
    c = req(prompts[1], max_tokens=4)
    ra, rb, rc = Result(), Result(), Result()
    for r, res in ((a, ra), (b, rb), (c, rc)):
        core.add_request(r, res.on_event)
    core.cancel(c.request_id)                            # still waiting
    assert rc.first.finish_reason == "cancelled" and rc.usage.completion_tokens == 0
    seq_a = core.requests[a.request_id].seqs[0]
    step_until(core, lambda: len(ra.ids) >= 3)
    assert seq_a.pinned
    core.cancel(a.request_id)
    assert ra.first.finish_reason == "cancelled" and ra.events[-1].done
    assert ra.usage.completion_tokens == len(ra.ids) >= 3   # tokens sampled before the cancel all reach it
    core.cancel(a.request_id)                            # unknown now: a no-op
    step_until(core, lambda: not core.has_work())
    assert rb.first.finish_reason == "length" and len(rb.ids) == 4
    assert not core.requests
    assert core.pool.num_free_blocks == core.baseline_free_blocks


def test_async_engine_cancel_and_break_free_blocks(core, prompts, greedy_alone):
    async def until(cond: Callable[[], bool], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.05)

    async def main() -> None:
        engine = AsyncEngine(core.config, build=lambda config, progress: core)
        engine.start()
        try:
            await engine.wait_ready()
            got = 0
            async for ev in engine.generate(req(prompts[1], max_tokens=100)):
                got += len(ev.token_ids)
                if got >= 2:
                    break                                # the generator's finally cancels it
            await until(lambda: not core.requests)

            r = req(prompts[2], cache_prompt=True, max_tokens=100)
            events = []
            async for ev in engine.generate(r):
                events.append(ev)
                if len(events) == 2:
                    engine.cancel(r.request_id)
            assert events[-1].finish_reason == "cancelled" and events[-1].done
            assert events[-1].usage.completion_tokens < 100

            done = Result()
            async for ev in engine.generate(req(prompts[0], max_tokens=MAX_TOKENS)):
                done.on_event(ev)
            assert done.ids == greedy_alone[0].ids
            await until(lambda: not core.requests)
        finally:
            engine.shutdown()

    asyncio.run(main())
    assert core.pool.num_free_blocks == core.baseline_free_blocks


# ------------------------------------------------------------------------ request features
def test_stop_string_spanning_two_tokens(tok, mixed, greedy_alone):
    stop, k, before = spanning_stop(tok, greedy_alone[6].ids)
    res = mixed["stop_str"].first
    assert res.finish_reason == "stop" and res.stop_reason == stop
    assert res.text == before and stop not in res.text
    assert res.token_ids == greedy_alone[6].ids[:k + 1]
    incl = mixed["stop_str_incl"].first
    assert incl.text == before + stop and incl.finish_reason == "stop"


def test_stop_token_ids(core, tok, prompts, greedy_alone):
    ids = greedy_alone[4].ids
    m = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i] and ids[i] not in tok.eos_ids)
    res = run(core, req(prompts[4], stop_token_ids=[ids[m]], max_tokens=MAX_TOKENS))[0].first
    assert res.finish_reason == "stop" and res.stop_reason == ids[m]
    assert res.token_ids == ids[:m + 1]
    assert res.text == tok.decode(ids[:m])


def test_n_choices_are_distinct_and_usage_sums(mixed, prompts):
    res = mixed["n4"]
    assert sorted(res.choices) == [0, 1, 2, 3]
    outs = [tuple(c.token_ids) for c in res.choices.values()]
    assert len(set(outs)) == 4
    assert res.usage.completion_tokens == sum(map(len, outs))
    assert res.usage.prompt_tokens == len(prompts[3])
    assert [ev.done for ev in res.events].count(True) == 1


def test_max_tokens_finishes_with_length(mixed, greedy_alone):
    res = mixed["length"]
    assert res.first.finish_reason == "length" and res.ids == greedy_alone[2].ids[:4]
    assert res.usage.completion_tokens == 4


# ------------------------------------------------------------------ asynchronous scheduling
def _async_workload(core, tok, prompts, greedy_alone, cancel_after: int | None = None) -> tuple[list[Result], int]:
    """One batch whose choices end at different steps (max_tokens, a stop token id standing in for EOS,
    a stop string), with penalties (the device fills the pending token's history slot) and a seeded
    sampler; optionally one long request cancelled after `cancel_after` steps. Returns the results and
    the steps launched before the previous one was read."""
    stop, _, _ = spanning_stop(tok, greedy_alone[6].ids) or pytest.fail("no spanning stop string")
    ids4 = greedy_alone[4].ids
    m = next(i for i in range(1, len(ids4)) if ids4[i] not in ids4[:i] and ids4[i] not in tok.eos_ids)
    reqs = [req(prompts[0], max_tokens=2), req(prompts[1], ignore_eos=True, max_tokens=9),
            req(prompts[4], stop_token_ids=[ids4[m]], max_tokens=MAX_TOKENS),
            req(prompts[6], stop=[stop], max_tokens=MAX_TOKENS),
            req(prompts[5], frequency_penalty=-1.0, presence_penalty=-2.0, logprobs=5, max_tokens=8),
            req(prompts[2], **SEEDED)]
    results = [Result() for _ in reqs]
    core.pool.reset_prefix_cache()   # both runs compute every prompt (usage.cached_tokens alike)
    before = core.counters.overlapped_steps
    for r, res in zip(reqs, results):
        core.add_request(r, res.on_event)
    cancelled = req(prompts[3], max_tokens=40)
    if cancel_after is not None:
        results.append(Result())
        core.add_request(cancelled, results[-1].on_event)
    for i in range(400):
        if not core.has_work():
            break
        if i == cancel_after:
            core.cancel(cancelled.request_id)
        core.step()
    assert not core.requests and core.pool.num_free_blocks == core.baseline_free_blocks
    return results, core.counters.overlapped_steps - before


def test_async_scheduling_gives_the_synchronous_outputs(core, tok, prompts, greedy_alone):
    """--async-scheduling on launches each decode step before reading the last one; every choice's
    tokens, text, finish and logprob-free events are those of the synchronous engine, greedy and seeded."""
    assert core.async_scheduling   # the fixture's
    try:
        core.async_scheduling = False
        sync, overlapped_sync = _async_workload(core, tok, prompts, greedy_alone, cancel_after=14)
    finally:
        core.async_scheduling = True
    asyn, overlapped = _async_workload(core, tok, prompts, greedy_alone, cancel_after=14)
    assert overlapped_sync == 0 and overlapped >= 8
    for a, b in zip(asyn[:-1], sync[:-1]):
        assert (a.first.token_ids, a.first.text, a.first.finish_reason, a.first.stop_reason) == (
            b.first.token_ids, b.first.text, b.first.finish_reason, b.first.stop_reason)
        assert a.usage == b.usage
        for x, y in zip(a.first.logprobs, b.first.logprobs):   # the penalised row's: history and all
            assert x.token_id == y.token_id and [t for t, _ in x.top] == [t for t, _ in y.top]
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=1e-4)
    finish = [r.first.finish_reason for r in asyn]
    assert finish == ["length", "length", "stop", "stop", "length", "length", "cancelled"]
    assert [len(r.ids) for r in asyn[:2]] == [2, 9] and asyn[0].ids == greedy_alone[0].ids[:2]
    assert asyn[-1].usage.completion_tokens == len(asyn[-1].ids) > 0
    assert asyn[4].ids != run(core, req(prompts[5], max_tokens=8))[0].ids   # the penalties bite
    assert core.step_fn.compilations_after_warmup == 0


def test_async_scheduling_auto_overlaps_steps_and_off_does_not() -> None:
    """--async-scheduling auto, the default, overlaps steps on every backend (a CPU's too: PERF.md); off does not."""
    from imp_jax.runtime.config import overlaps_steps

    assert EngineConfig().async_scheduling == "auto"
    assert [overlaps_steps(v) for v in ("auto", "on", "off")] == [True, True, False]
    assert EngineConfig().async_scheduling_on() and not EngineConfig(async_scheduling="off").async_scheduling_on()
    with pytest.raises(ValueError, match="--async-scheduling .yes.: expected one of auto, on, off"):
        EngineConfig(async_scheduling="yes")


def test_async_scheduling_keeps_the_token_of_a_sequence_preempted_while_its_step_runs(core, prompts, greedy_alone):
    """A decode that needs blocks preempts a sequence whose sampled token is still on the device: the
    token joins the sequence when its step is read, and the sequence recomputes and ends as alone."""
    a, b = req(prompts[0], max_tokens=MAX_TOKENS), req(prompts[1], max_tokens=MAX_TOKENS)
    ra, rb = Result(), Result()
    core.add_request(a, ra.on_event)
    core.add_request(b, rb.on_event)
    seq_b = core.requests[b.request_id].seqs[0]
    step_until(core, lambda: len(rb.ids) >= 1 and seq_b.pending == 1)
    assert core._inflight is not None and any(c.seq is seq_b for c in core._inflight.chunks)
    core.scheduler.preempt(seq_b)   # what Scheduler._grow does for a decode short of blocks
    n_out = len(seq_b.output_ids)
    core.step()
    assert len(seq_b.output_ids) == n_out + 1 and seq_b.pending == 0   # read, not lost
    step_until(core, lambda: not core.has_work(), max_steps=100)
    assert ra.ids == greedy_alone[0].ids and rb.ids == greedy_alone[1].ids
    assert seq_b.num_preemptions == 1 and core.pool.num_free_blocks == core.baseline_free_blocks


def test_async_scheduling_reads_a_grammar_rows_token_before_the_next_step(core, prompts):
    """A constrained row's next mask follows its last token: those steps are not overlapped, and the
    output still follows the grammar; the unconstrained neighbour overlaps again once it runs alone."""
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_regex(r"(yes|no), [0-9]{2}")
    g = GenerationRequest("c-async", prompts[0], SamplingParams(temperature=0.0, max_tokens=30),
                          constraint=grammar)
    free = req(prompts[1], ignore_eos=True, max_tokens=24)
    rg, rf = Result(), Result()
    core.add_request(g, rg.on_event)
    core.add_request(free, rf.on_event)
    before = core.counters.overlapped_steps
    step_until(core, lambda: rg.usage is not None, max_steps=100)
    assert core.counters.overlapped_steps - before <= 1   # at most the step after the grammar row ended
    assert re.fullmatch(r"(yes|no), [0-9]{2}", rg.first.text) and rg.first.finish_reason == "stop"
    step_until(core, lambda: not core.has_work(), max_steps=100)
    assert core.counters.overlapped_steps - before >= 3 and len(rf.ids) == 24
    assert core.pool.num_free_blocks == core.baseline_free_blocks


def test_requests_that_cannot_fit_are_rejected_at_add_request(core, tiny_core, tok):
    long = (tok.encode(PASSAGE) * 3)[:MAX_MODEL_LEN]
    bad = [
        (core, req(long, max_tokens=4), "context_length_exceeded"),
        (core, req(long[:200], max_tokens=100), "context_length_exceeded"),
        (tiny_core, req(long[:200], max_tokens=4), "context_length_exceeded"),   # pool too small
        (core, req(long[:20], max_tokens=4, logit_bias={i: 1.0 for i in range(100)}), None),
        (core, req([], max_tokens=4), None),
        (core, req(long[:20], n=5), None),
    ]
    rejections = tiny_core.stats()["kv_pressure_rejections"]
    for engine, r, code in bad:
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request(r, lambda ev: pytest.fail("no event expected"))
        if code:
            assert info.value.code == code
        assert not engine.requests and not engine.scheduler.waiting
    assert tiny_core.stats()["kv_pressure_rejections"] == rejections + 1   # the pool, not the context


def test_ignore_eos_and_min_tokens(core, tok):
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    prompt = tok.encode(chat, add_special_tokens=False)
    plain, ignore, at_least = run(core, req(prompt, max_tokens=12),
                                  req(prompt, ignore_eos=True, max_tokens=10),
                                  req(prompt, min_tokens=10, max_tokens=12))
    assert plain.first.finish_reason == "stop" and plain.first.stop_reason in tok.eos_ids, plain.first
    n = len(plain.ids) - 1                                  # tokens before the EOS
    assert plain.ids[-1] in tok.eos_ids and "Paris" in plain.first.text
    assert ignore.first.finish_reason == "length" and len(ignore.ids) == 10
    assert ignore.ids[:n + 1] == plain.ids                  # EOS sampled, then generation goes on
    assert len(at_least.ids) >= 10 and at_least.ids[:n] == plain.ids[:n]
    assert not set(at_least.ids[:10]) & tok.eos_ids         # EOS is not sampled before min_tokens


def test_logprobs_are_sorted_and_greedy_takes_the_top(mixed, greedy_alone):
    res = mixed["logprobs"].first
    assert res.token_ids == greedy_alone[0].ids
    assert len(res.logprobs) == len(res.token_ids)
    for tok_id, lp in zip(res.token_ids, res.logprobs):
        assert lp.token_id == tok_id and len(lp.top) == 5
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert lp.top[0][0] == tok_id and lp.logprob == pytest.approx(lp.top[0][1], abs=1e-5)
    knobs = mixed["knobs"].first
    assert len(knobs.logprobs) == len(knobs.token_ids) and all(len(lp.top) == 2 for lp in knobs.logprobs)
    assert all(-1e9 < lp.logprob <= 0 for lp in knobs.logprobs)
    assert greedy_alone[5].ids[0] not in knobs.token_ids     # logit_bias -100 bans it


def test_no_compilation_after_warm_up_over_a_mixed_workload(core, tiny_core, mixed):
    assert core.step_fn.compilations_after_warmup == 0
    assert tiny_core.step_fn.compilations_after_warmup == 0


def test_a_scored_prompt_waits_for_blocks_like_any_prompt(tiny_core, prompts, greedy_alone):
    """prompt_logprobs reserve the prompt's blocks at admission like any prompt: with the pool taken by a running
    request the scored one waits (no 503), then runs with the same entries and tokens as alone."""
    alone = run(tiny_core, req(prompts[7], max_tokens=4, prompt_logprobs=2))[0]
    together = run(tiny_core, req(prompts[6], max_tokens=MAX_TOKENS), req(prompts[7], max_tokens=4, prompt_logprobs=2))
    assert together[0].ids == greedy_alone[6].ids and together[1].ids == alone.ids == greedy_alone[7].ids[:4]
    got, want = together[1].events[0].prompt_logprobs, alone.events[0].prompt_logprobs
    assert len(got) == len(prompts[7]) and [e.token_id for e in got[1:]] == [e.token_id for e in want[1:]]
    assert all(abs(a.logprob - b.logprob) < 1e-5 for a, b in zip(got[1:], want[1:]))


def test_prompt_logprobs_are_the_raw_model_distribution(core, prompts, greedy_alone, hf_smollm2):
    import torch

    prompt = prompts[2]   # longer than the token budget: scored in several chunks
    assert len(prompt) > core.step_fn.score_tokens
    (res,) = run(core, req(prompt, max_tokens=4, prompt_logprobs=3))
    assert res.ids == greedy_alone[2].ids[:4]   # scoring the prompt leaves generation unchanged
    entries = res.events[0].prompt_logprobs
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    assert all(ev.prompt_logprobs is None for ev in res.events[1:])
    with torch.no_grad():
        ref = torch.log_softmax(hf_smollm2(torch.tensor([prompt])).logits[0], -1).numpy()
    for i, e in enumerate(entries[1:], start=1):
        assert e.token_id == prompt[i] and len(e.top) == 3
        assert abs(e.logprob - ref[i - 1, prompt[i]]) < 1e-3
        assert e.rank == int((ref[i - 1] > ref[i - 1, prompt[i]]).sum()) + 1 or abs(
            e.logprob - sorted(ref[i - 1])[-e.rank]) < 1e-4   # ties may order either way
        assert [v for _, v in e.top] == sorted((v for _, v in e.top), reverse=True)
        assert abs(e.top[0][1] - ref[i - 1].max()) < 1e-3


def test_scoring_a_prompt_does_not_stall_running_streams(core, prompts, greedy_alone):
    """A prompt being scored (prompt_logprobs) prefills through the scheduler under the step's token budget:
    a running request gets a token on every step meanwhile, its steps still overlap (asynchronous scheduling
    stays on for it), and both end as they would alone."""
    ra, rb = Result(), Result()
    core.add_request(req(prompts[0], max_tokens=6), ra.on_event)
    step_until(core, lambda: len(ra.ids) >= 1)
    core.add_request(req(prompts[2], max_tokens=4, prompt_logprobs=1), rb.on_event)
    chunks = -(-len(prompts[2]) // core.step_fn.score_tokens)
    assert chunks >= 3
    overlapped = core.counters.overlapped_steps
    for _ in range(chunks - 1):          # the prompt is still being scored after these steps
        before = len(ra.ids)
        core.step()
        assert len(ra.ids) >= before + 1 and not rb.events
    assert core.counters.overlapped_steps > overlapped
    step_until(core, lambda: not core.has_work(), max_steps=200)
    assert ra.ids == greedy_alone[0].ids[:6] and rb.ids == greedy_alone[2].ids[:4]
    assert len(rb.events[0].prompt_logprobs) == len(prompts[2])
    assert core.pool.num_free_blocks == core.baseline_free_blocks


def test_a_grammar_constrains_every_choice_and_eos_comes_where_it_accepts(core, prompts):
    """GenerationRequest.constraint (an llguidance grammar): sampled text follows it, the answer
    ends at EOS as soon as the grammar is complete, and a masked token reads logprob -inf."""
    import json

    import jsonschema
    import llguidance

    regex = llguidance.LLMatcher.grammar_from_regex(r"(yes|no), [0-9]{2}")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
    reqs = [GenerationRequest("c-regex", prompts[0], SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=30),
                              constraint=regex),
            GenerationRequest("c-json", prompts[1], SamplingParams(temperature=0.0, max_tokens=60, logprobs=5),
                              constraint=grammar)]
    (rx, js) = run(core, *reqs)
    for choice in rx.choices.values():
        assert re.fullmatch(r"(yes|no), [0-9]{2}", choice.text), choice.text
        assert choice.finish_reason == "stop"
    (choice,) = js.choices.values()
    jsonschema.validate(json.loads(choice.text), schema)
    assert choice.finish_reason == "stop"
    # greedy under a mask: the sampled token is the best allowed one, alternatives never disallowed ones
    assert all(lp.top[0][0] == lp.token_id for lp in choice.logprobs)
    first = choice.logprobs[0]   # the grammar allows only an opening brace here: probability 1, the rest 0
    assert core.tokenizer.decode([first.token_id]).startswith("{") and first.logprob == 0.0
    assert all(v == float("-inf") for _, v in first.top[1:])


def test_bfloat16_kv_cache_runs_batch_invariant(core, prompts, greedy_alone):
    """--kv-cache-dtype bfloat16 under the float32 model: K/V stored in bfloat16 (the CPU attention
    kernel reads them), greedy outputs batch invariant and, for these confident first tokens, the
    same as with float32 K/V; the pool returns to its baseline (run() checks it)."""
    config = dataclasses.replace(core.config, max_num_seqs=2, kv_cache_dtype="bfloat16")
    engine = make_engine(core.loaded, config, BIG_POOL_BLOCKS, kv_dtype=jnp.bfloat16)   # its bits, on a CPU
    # warm-up ran every bucket once, on all-padding batches that write no KV
    assert not any(bool(jnp.any(c)) for c in engine.step_fn.kv)
    alone = [run(engine, req(p, max_tokens=MAX_TOKENS))[0] for p in prompts[:2]]
    engine.pool.reset_prefix_cache()
    together = run(engine, *(req(p, max_tokens=MAX_TOKENS) for p in prompts[:2]))
    assert [r.ids for r in together] == [r.ids for r in alone]
    assert all(r.ids[:3] == g.ids[:3] for r, g in zip(alone, greedy_alone))
    assert engine.step_fn.kv[0].dtype == kv_storage_dtype(jnp.bfloat16, "cpu") and engine.step_fn.kv[0].dtype.itemsize == 2
    assert engine.step_fn.compilations_after_warmup == 0


def test_device_block_tables_hold_every_launched_rows_blocks(core, tiny_core, tok, prompts, monkeypatch):
    """The step reads block tables from device-resident rows it edits in place (runtime/scheduling/block_tables.py):
    after every launch, each scheduled sequence's row holds its blocks, through preemption (tiny_core),
    prefix-cache hits written by the separate table program, and prompt scoring."""
    checked = {"rows": 0}

    def checking(step_fn, name):
        original = getattr(step_fn, name)

        def run(*args, **kwargs):
            tables = args[3] if name == "launch" else args[2]
            out = original(*args, **kwargs)
            device = np.asarray(step_fn.tables)
            for table in tables:
                assert table.device_synced == len(table.block_ids)
                assert list(device[table.device_slot, :len(table.block_ids)]) == table.block_ids
                checked["rows"] += 1
            return out
        monkeypatch.setattr(step_fn, name, run)

    for c in (core, tiny_core):
        checking(c.step_fn, "launch")
        checking(c.step_fn, "score")
    ids = tok.encode(PASSAGE)
    before = tiny_core.scheduler.num_preemptions
    run(tiny_core, *(req(p, max_tokens=8) for p in (ids[:31], ids[40:71], ids[80:127], ids[110:157])),
        req(prompts[1], **{**SEEDED, "max_tokens": 8}))
    assert tiny_core.scheduler.num_preemptions > before
    core.pool.reset_prefix_cache()
    writes = core.step_fn.table_writes
    run(core, req(prompts[2], max_tokens=2, cache_prompt=True))
    # no drafts: a verify chunk's larger bucket would carry the edits this checks the table program for
    again = run(core, dataclasses.replace(req(prompts[2], max_tokens=2), speculative=False),
                req(prompts[2], max_tokens=2, prompt_logprobs=1))
    assert again[0].usage.cached_tokens > 0 and again[1].events[0].prompt_logprobs
    assert core.step_fn.table_writes > writes   # a long cached prefix: more edits than a step carries
    assert checked["rows"] > 20


# ------------------------------------------------------------------------ failure isolation
class Poison:
    """A fault hook (EngineCore.fault_hook) that raises at `stage` whenever a sequence of `request_id` is in
    the step's (or the sequence's) work, at most `times` times."""

    def __init__(self, stage: str, request_id: str, times: int = 10**6):
        self.stage, self.request_id, self.left, self.fired = stage, request_id, times, 0

    def __call__(self, stage: str, seqs) -> None:
        if stage == self.stage and self.left and any(s.request.request_id == self.request_id for s in seqs):
            self.left -= 1
            self.fired += 1
            raise ValueError(f"injected fault at {stage}")


def _failed_step(res: Result) -> bool:
    last = res.events[-1]
    return last.done and last.finish_reason == "error" and last.extra.get("code") == "engine_step_failed"


@pytest.mark.parametrize("stage", ["prepare", "advance", "emit"])
def test_a_fault_in_one_sequences_host_work_fails_only_its_request(core, prompts, greedy_alone, stage):
    """The poisoned request ends with engine_step_failed at once; the requests beside it in the same steps
    finish with the tokens they give alone; the pool is back at baseline and the engine serves on."""
    poisoned = req(prompts[3], max_tokens=MAX_TOKENS)
    hook = core.fault_hook = Poison(stage, poisoned.request_id)
    failed0 = core.counters.steps_failed
    try:
        results = run(core, req(prompts[0], max_tokens=MAX_TOKENS), poisoned, req(prompts[2], max_tokens=MAX_TOKENS))
    finally:
        core.fault_hook = None
    assert hook.fired == 1 and core.counters.steps_failed == failed0 + 1
    assert _failed_step(results[1])
    assert results[0].ids == greedy_alone[0].ids and results[2].ids == greedy_alone[2].ids
    assert run(core, req(prompts[3], max_tokens=MAX_TOKENS))[0].ids == greedy_alone[3].ids
    assert core.stats()["steps_failed_total"] == failed0 + 1


@pytest.mark.parametrize("stage", ["launch", "read"])
def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(core, prompts, greedy_alone, stage):
    """A whole step that raises (launching or reading it) fails the requests in it (and in the step launched on
    its tokens); the requests waiting meanwhile (9 requests, 8 sequences at most) finish as alone; nothing
    leaks; the next requests run normally."""
    first = req(prompts[4], max_tokens=MAX_TOKENS)
    hook = core.fault_hook = Poison(stage, first.request_id, times=1)
    try:
        results = run(core, first, *(req(p, max_tokens=MAX_TOKENS) for p in prompts))
    finally:
        core.fault_hook = None
    assert hook.fired == 1 and _failed_step(results[0])
    for res, alone in zip(results[1:], greedy_alone):
        assert _failed_step(res) or res.ids == alone.ids
    assert any(not _failed_step(res) for res in results[1:])
    after = run(core, req(prompts[4], max_tokens=MAX_TOKENS), req(prompts[6], max_tokens=MAX_TOKENS))
    assert [r.ids for r in after] == [greedy_alone[4].ids, greedy_alone[6].ids]


def test_a_device_fault_still_reaches_the_async_engine(core, prompts) -> None:
    """A runtime error from the device (not an out-of-memory) is not the step's to absorb: it propagates."""
    from imp_jax.runtime.core.faults import is_device_fault

    def device_lost(stage: str, seqs) -> None:
        if stage == "read":
            raise _runtime_error("INTERNAL: device lost")

    core.fault_hook = device_lost
    try:
        core.add_request(req(prompts[0], max_tokens=2), lambda ev: None)
        with pytest.raises(Exception) as info:
            for _ in range(20):
                core.step()
        assert is_device_fault(info.value, False, False)
    finally:
        core.fault_hook = None
        core.fail_all("test")
    assert core.pool.num_free_blocks == core.baseline_free_blocks
    oom = _runtime_error("RESOURCE_EXHAUSTED: out of memory")
    assert not is_device_fault(oom, False, False) and is_device_fault(oom, False, True)
    assert not is_device_fault(ValueError("x"), False, False) and is_device_fault(ValueError("x"), True, False)


def _runtime_error(message: str) -> Exception:
    import jax
    try:
        return jax.errors.JaxRuntimeError(message)
    except TypeError:   # not constructible from Python in this jax: a subclass stands in
        return type("FakeRuntimeError", (jax.errors.JaxRuntimeError,), {})(message)


def test_the_async_engine_stays_ready_after_a_failed_step(core, prompts, greedy_alone) -> None:
    """Through the AsyncEngine: the failed request's stream ends with an engine_step_failed error event, the
    engine stays ready, and the next request streams its greedy tokens."""
    async def main() -> None:
        engine = AsyncEngine(core.config, build=lambda config, progress: core)
        engine.start()
        try:
            await engine.wait_ready()
            bad = req(prompts[1], max_tokens=MAX_TOKENS)
            core.fault_hook = Poison("advance", bad.request_id)
            events = [ev async for ev in engine.generate(bad)]
            assert events[-1].finish_reason == "error" and events[-1].extra["code"] == "engine_step_failed"
            assert engine.state == "ready" and engine.stats()["steps_failed_total"] >= 1
            done = Result()
            async for ev in engine.generate(req(prompts[0], max_tokens=MAX_TOKENS)):
                done.on_event(ev)
            assert done.ids == greedy_alone[0].ids
        finally:
            core.fault_hook = None
            engine.shutdown()

    asyncio.run(main())
    assert core.pool.num_free_blocks == core.baseline_free_blocks
