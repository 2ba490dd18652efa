"""The scheduler's fair share across tenants: admission round-robin within a priority, preemption of the
tenant running the most (runtime/scheduling/scheduler.py). Sequences here are bare (no detokenizer): the scheduler
reads only their tokens, tables and request."""
from __future__ import annotations

from imp_jax.runtime.kv.kv_blocks import KVBlockPool
from imp_jax.runtime.request import GenerationRequest, SamplingParams
from imp_jax.runtime.scheduling.scheduler import Scheduler
from imp_jax.runtime.scheduling.sequence import Sequence, SeqStatus


def _seq(tenant: str | None, prompt_len: int = 8, priority: int = 0, arrival: float = 0.0) -> Sequence:
    req = GenerationRequest(f"r-{tenant}", list(range(1, prompt_len + 1)), priority=priority, tenant=tenant)
    return Sequence(request=req, index=0, params=SamplingParams(), max_tokens=4, detok=None, stops=None,
                    prompt_ids=list(req.prompt_ids), arrival=arrival)


def _scheduler(max_num_seqs: int, fair: bool = True, blocks: int = 256) -> Scheduler:
    return Scheduler(KVBlockPool(blocks, 4), max_num_seqs=max_num_seqs, max_num_batched_tokens=4096,
                     fair_tenants=fair)


def _admitted(s: Scheduler) -> list[str | None]:
    return [c.seq.request.tenant for c in s.schedule()]


def test_burst_cannot_starve_a_tenant_with_one_request() -> None:
    s = _scheduler(max_num_seqs=2)
    for _ in range(32):
        s.add(_seq("a", arrival=0.0))
    s.add(_seq("b", prompt_len=12, arrival=1.0))   # later and longer: last by rank alone
    assert sorted(_admitted(s)) == ["a", "b"]


def test_without_fairness_the_burst_goes_first() -> None:
    s = _scheduler(max_num_seqs=2, fair=False)
    for _ in range(32):
        s.add(_seq("a", arrival=0.0))
    s.add(_seq("b", prompt_len=12, arrival=1.0))
    assert _admitted(s) == ["a", "a"]


def test_rounds_count_what_a_tenant_already_runs() -> None:
    s = _scheduler(max_num_seqs=3)
    for _ in range(3):
        s.add(_seq("a"))
    assert _admitted(s) == ["a", "a", "a"]
    s.max_num_seqs = 6
    for _ in range(3):
        s.add(_seq("a"))
    for _ in range(3):
        s.add(_seq("b", prompt_len=12))
    admitted = _admitted(s)[3:]   # the three running decodes come first
    assert admitted == ["b", "b", "b"]   # b's rounds 0-2 before a's rounds 3-5


def test_priority_still_wins_over_rounds() -> None:
    s = _scheduler(max_num_seqs=1)
    s.add(_seq("a", priority=0))
    s.add(_seq("a", priority=-1, prompt_len=12))
    s.add(_seq("b", priority=0))
    chunks = s.schedule()
    assert [(c.seq.request.tenant, c.seq.request.priority) for c in chunks] == [("a", -1)]


def test_one_tenant_keeps_rank_order() -> None:
    s = _scheduler(max_num_seqs=3)
    lengths = [12, 4, 8]
    for n in lengths:
        s.add(_seq(None, prompt_len=n))
    assert [c.num_tokens for c in s.schedule()] == sorted(lengths)


def _preempted_when_short(fair: bool) -> list[str | None]:
    """Three of a's sequences and then b's decode, each into a new block, with blocks for two."""
    s = _scheduler(max_num_seqs=8, blocks=9, fair=fair)   # 8 usable blocks of 4 tokens
    seqs = [_seq("a", prompt_len=4, arrival=t) for t in (0.0, 1.0, 2.0)] + [_seq("b", prompt_len=4, arrival=3.0)]
    for q in seqs:
        s.add(q)
    s.schedule()
    for q in seqs:   # prompts done: each needs its second block next
        q.num_computed = len(q.prompt_ids)
        q.output_ids.append(7)
    s.pool.allocate(_seq("x").table, [], 4 * (s.pool.num_free_blocks - 2))
    s.schedule()
    return [q.request.tenant for q in seqs if q.status is SeqStatus.WAITING]


def test_preemption_takes_from_the_tenant_running_most() -> None:
    assert _preempted_when_short(fair=True) == ["a"]
    assert _preempted_when_short(fair=False) == ["b"]   # by arrival alone: the newest


def test_a_full_batch_gives_a_slot_to_a_tenant_below_its_share() -> None:
    s = _scheduler(max_num_seqs=4)
    burst = [_seq("a", arrival=float(t)) for t in range(4)]
    for q in burst:
        s.add(q)
    s.schedule()
    s.add(_seq("b", arrival=9.0))
    tenants = [c.seq.request.tenant for c in s.schedule()]
    assert sorted(tenants) == ["a", "a", "a", "b"]
    assert burst[-1].status is SeqStatus.WAITING   # a's newest gave its slot back
    s.add(_seq("b", arrival=10.0))
    assert sorted(c.seq.request.tenant for c in s.schedule()) == ["a", "a", "b", "b"]   # 3 against 1: one more back
    assert sorted(c.seq.request.tenant for c in s.schedule()) == ["a", "a", "b", "b"]   # 2 against 2: settled


def test_a_full_batch_of_one_tenant_preempts_nothing() -> None:
    s = _scheduler(max_num_seqs=2)
    for t in range(3):
        s.add(_seq("a", arrival=float(t)))
    s.schedule()
    s.schedule()
    assert s.num_preemptions == 0
