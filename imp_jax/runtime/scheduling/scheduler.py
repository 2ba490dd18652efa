"""Continuous batching: which sequences run this step, and how many tokens each, under a token budget.

Running decodes go first, then running prefills continue, then waiting sequences are
admitted: by `priority` (lower first), then round-robin across tenants (`request.tenant`: an
API key, else a client address), then shortest remaining prompt first, with aging so nothing
starves. Round-robin counts what a tenant already runs: a tenant's k-th waiting sequence (in
rank order, k from 0) goes in round `running + k`, lowest round first, so a tenant with 32
sequences queued cannot starve one with 1. When every slot (`max_num_seqs`) is taken and a
tenant waits running two or more fewer sequences than another, that other's newest sequence gives
its slot back (preempted), one a step, so a newcomer starts at once rather than when a sequence
ends (`fair_tenants=False`: rank alone, no such preemption). When blocks run out mid-decode the
worst-ranked running sequence is preempted: of the tenant running the most sequences (when fair),
the newest. A preempted sequence frees its blocks and later recomputes its KV from its tokens, or, with
a host tier (`swapper`, runtime/kv/kv_tiers.py) whose rule says swap, gets its KV copied back when readmitted.

Atomic spans (a bidirectional model's images, `Sequence.chunk_fit`): a prefill chunk is cut back to the start
of a span it would end inside. A sequence cut to nothing (its next span does not fit what the step has left)
is held until it runs: each step schedules held sequences first, before the decodes, so the first of them
has the whole budget, which holds any span (the images feature refuses longer ones): none starves behind
decodes or other prefills (nor, taking turns, behind each other); the decodes they displace run a step later.
"""
from __future__ import annotations

import dataclasses
import time
from collections import Counter
from typing import Callable, Protocol

from imp_jax.runtime.decoding.cfg import split_budget
from imp_jax.runtime.kv.kv_blocks import KVBlockPool
from imp_jax.runtime.scheduling.sequence import Sequence, SeqStatus


class Swapper(Protocol):
    """Moves a preempted sequence's KV out of the pool and back, and stages disk-tier prefixes into host memory
    before admission (runtime/kv/kv_tiers.py KVTiers)."""

    def swap_out(self, seq: Sequence) -> bool: ...      # before its blocks are freed: whether it swapped
    def swapped_tokens(self, seq: Sequence) -> int: ...  # computed tokens swap_in gives back (0: none)
    def swap_in(self, seq: Sequence) -> None: ...        # its fresh table's first blocks get them
    def drop(self, seq: Sequence) -> None: ...           # it ended while swapped out
    def staged(self, seq: Sequence) -> bool: ...         # False while its prefix is read from disk (it waits)


@dataclasses.dataclass(frozen=True)
class ScheduledChunk:
    """`num_tokens` tokens of `seq` starting at `seq.num_computed` run this step; the last
    len(drafts) of them are speculative drafts after its newest token (runtime/decoding/speculative.py),
    each verified by a sampled row of its own."""

    seq: Sequence
    num_tokens: int
    drafts: tuple[int, ...] = ()

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's newest token, so the step samples its next one."""
        return self.seq.num_computed + self.num_tokens - len(self.drafts) == self.seq.num_tokens


class Scheduler:
    """Holds the waiting and running sequences and picks each step's chunks."""

    def __init__(self, pool: KVBlockPool, *, max_num_seqs: int, max_num_batched_tokens: int,
                 aging_tokens_per_s: float = 256.0, fair_tenants: bool = True):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.aging_tokens_per_s = aging_tokens_per_s
        self.fair_tenants = fair_tenants
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # speculative decoding (runtime/decoding/speculative.py): a decoding sequence's drafts, at most the
        # given count; None: no drafting
        self.drafter: Callable[[Sequence, int], list[int]] | None = None
        self.max_draft_batch = 0   # draft only in steps of at most this many decoding sequences (0: any)
        self.swapper: Swapper | None = None   # the host KV tier, when there is one
        self.held: list[Sequence] = []         # cut to nothing by an atomic span, not run since: they go first
        # the token counts a step program is compiled for (the engine's buckets); a step is padded to the next
        self.step_sizes: list[int] = []

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or cancelled sequence and free its blocks (and pins)."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        self.pool.unpin(seq.table)
        if self.swapper is not None:
            self.swapper.drop(seq)
        seq.status = SeqStatus.FINISHED
        if seq.shadow is not None:   # CFG (runtime/decoding/cfg.py): the shadow ends with its main
            self._release(seq.shadow)
            seq.shadow.status = SeqStatus.FINISHED

    def has_work(self) -> bool:
        return bool(self.running) or any(s.can_start for s in self.waiting)

    def _rank(self, seq: Sequence, now: float) -> tuple[int, float]:
        remaining = seq.num_tokens - seq.num_computed
        return seq.request.priority, remaining - self.aging_tokens_per_s * (now - seq.arrival)

    def _admission_order(self, now: float) -> list[Sequence]:
        """The waiting sequences in the order admission tries them: by rank, interleaved across tenants
        by round (module docstring). One tenant alone keeps the rank order exactly."""
        ranked = sorted(self.waiting, key=lambda s: self._rank(s, now))
        if not self.fair_tenants:
            return ranked
        rounds = self._running_per_tenant()
        order: list[tuple[int, int, int, Sequence]] = []
        for position, seq in enumerate(ranked):
            slot = (seq.request.priority, seq.request.tenant)
            order.append((seq.request.priority, rounds[slot], position, seq))
            rounds[slot] += 1
        return [seq for *_, seq in sorted(order, key=lambda o: o[:3])]

    def _free_a_slot_for_a_tenant_below_its_share(self) -> None:
        """With every slot taken and a tenant waiting that runs at least two fewer sequences of its priority
        than another, preempt that other's newest sequence of the priority: the waiting tenant gets the
        slot this step instead of when a sequence ends. One per step; each move narrows the gap."""
        if len(self.running) < self.max_num_seqs:
            return
        counts = self._running_per_tenant()
        for want in sorted((s for s in self.waiting if s.can_start and s.shadow is None),
                           key=lambda s: (s.request.priority, counts[(s.request.priority, s.request.tenant)])):
            prio, floor = want.request.priority, counts[(want.request.priority, want.request.tenant)] + 1
            victims = [s for s in self.running if s.shadow is None and s.request.priority == prio
                       and counts[(prio, s.request.tenant)] > floor]
            if victims:
                self.preempt(max(victims, key=lambda s: (counts[(prio, s.request.tenant)], s.arrival)))
                return

    def _running_per_tenant(self) -> Counter:
        """Running sequences per (priority, tenant): where each tenant's next round starts."""
        return Counter((s.request.priority, s.request.tenant) for s in self.running)

    def schedule(self) -> list[ScheduledChunk]:
        """This step's chunks: decodes, then continuing prefills, then admissions."""
        now = time.monotonic()
        if self.fair_tenants:
            self._free_a_slot_for_a_tenant_below_its_share()
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        scheduled: set[int] = set()
        self.held = [s for s in self.held if s.status is not SeqStatus.FINISHED]
        for seq in list(self.held):   # the module docstring: a sequence an atomic span held back goes first
            if budget == 0 or len(chunks) == self.max_num_seqs:
                break
            n = self._admit(seq, budget, now) if seq.status is SeqStatus.WAITING and seq.can_start else 0
            if n:
                chunks.append(ScheduledChunk(seq, n))
                scheduled.add(seq.seq_id)
                budget -= n
        first = {s.seq_id for s in self.held}
        order = sorted(self.running, key=lambda s: (s.seq_id not in first, s.is_prefill, s.request.priority,
                                                    s.arrival))
        for seq in order:
            if seq.status is not SeqStatus.RUNNING or seq.seq_id in scheduled:
                continue  # preempted earlier in this pass, or admitted above
            if budget == 0 or len(chunks) == self.max_num_seqs:
                break
            if seq.shadow is not None:   # a CFG pair runs together (runtime/decoding/cfg.py)
                pair = self._grow_pair(seq, budget, self.max_num_seqs - len(chunks), scheduled)
                chunks += pair
                budget -= sum(c.num_tokens for c in pair)
                continue
            n = self._chunk(seq, seq.num_computed, min(seq.num_tokens - seq.num_computed, budget), budget)
            if n and self._grow(seq, n, scheduled):
                chunks.append(ScheduledChunk(seq, n))
                scheduled.add(seq.seq_id)
                budget -= n
        for seq in self._admission_order(now):
            if budget == 0 or len(chunks) == self.max_num_seqs:
                break
            if seq.seq_id in scheduled:
                continue
            if seq.shadow is not None:
                pair = self._admit_pair(seq, budget, self.max_num_seqs - len(chunks), now) if seq.can_start else []
                chunks += pair
                scheduled.update(c.seq.seq_id for c in pair)
                budget -= sum(c.num_tokens for c in pair)
                continue
            n = self._admit(seq, budget, now) if seq.can_start else 0
            if n:
                chunks.append(ScheduledChunk(seq, n))
                scheduled.add(seq.seq_id)
                budget -= n
        self.held = [s for s in self.held if s.seq_id not in scheduled]
        return self._add_drafts(chunks, budget) if self.drafter is not None else chunks

    def _add_drafts(self, chunks: list[ScheduledChunk], budget: int) -> list[ScheduledChunk]:
        """Give decode chunks drafts from what the step has left: tokens of the budget, and sampled
        rows (each draft takes one; the largest step samples `max_num_seqs` rows). Drafts never
        take blocks from anyone: a sequence the pool cannot extend decodes plainly. None in a step
        of more than `max_draft_batch` decoding sequences."""
        decoding = sum(c.num_tokens == 1 for c in chunks)
        if self.max_draft_batch and decoding > self.max_draft_batch:
            return chunks
        rows = self.max_num_seqs - len(chunks)
        free = self.pool.num_free_blocks
        for i, c in enumerate(chunks):
            if rows <= 0 or budget <= 0:
                break
            seq = c.seq
            if c.num_tokens != 1 or not c.samples or seq.pending or seq.shadow is not None or seq.main is not None:
                continue
            drafts = self.drafter(seq, min(rows, budget))
            if not drafts:
                continue
            n = 1 + len(drafts)
            if self.pool.blocks_needed(seq.table, (), seq.num_computed + n) > free - self.reserved_blocks():
                continue
            self.pool.allocate(seq.table, (), seq.num_computed + n)
            chunks[i] = ScheduledChunk(seq, n, tuple(drafts))
            rows -= len(drafts)
            budget -= len(drafts)
        return chunks

    def _admit(self, seq: Sequence, budget: int, now: float) -> int:
        """Move `seq` to running if its whole prompt fits in the blocks not promised to others.

        Returns the token count of its first chunk (after the prefix-cache hits), 0 if it waits.
        """
        if self.swapper is not None and self.swapper.swapped_tokens(seq):
            return self._admit_swapped(seq, budget, now)
        if self.swapper is not None and not self.swapper.staged(seq):
            return 0   # its prefix is being read from the disk tier, off this thread
        ids, salt = seq.all_ids, seq.cache_key
        needed = self.pool.blocks_needed(seq.table, ids, len(ids), salt)
        if needed > self.pool.num_free_blocks - self.reserved_blocks():
            return 0
        cached = self.pool.cached_tokens(ids, salt)
        n = self._chunk(seq, cached, min(len(ids) - cached, budget), budget)
        if not n or not self.pool.allocate(seq.table, ids, cached + n, salt):  # one lookup: takes the hits
            return 0
        seq.num_computed = seq.table.num_cached_tokens
        self._start(seq, now)
        return n

    def _admit_swapped(self, seq: Sequence, budget: int, now: float) -> int:
        """Readmit a swapped-out sequence: fresh blocks for all its tokens, its computed KV copied back into
        them before the step (the swapper queues it), its first chunk from there. It waits while a token of
        its is still on the device (read next step), so its known tokens are all it has."""
        saved = self.swapper.swapped_tokens(seq)
        if seq.pending:
            return 0
        pool = self.pool
        if pool.num_blocks_for(seq.num_tokens) > pool.num_free_blocks - self.reserved_blocks():
            return 0
        n = self._chunk(seq, saved, min(seq.num_tokens - saved, budget), budget)
        if not n or not pool.allocate(seq.table, (), saved + n):
            return 0
        self.swapper.swap_in(seq)
        seq.num_computed = saved
        pool.commit(seq.table, seq.all_ids[:saved], seq.cache_key)   # its full blocks join the prefix cache
        self._start(seq, now)
        return n

    def _chunk(self, seq: Sequence, start: int, n: int, budget: int) -> int:
        """A prefill chunk of `n` tokens from `start` (`_fit`), first cut back to end the step at a compiled
        step size when the step would otherwise pass that size by fewer tokens than its padding to the
        next: 8 decodes and a 128-token prompt run as 128 tokens now and 16 next step, not as 256 rows
        of which 120 are padding. Not into an atomic span (that would hold the sequence)."""
        used = self.max_num_batched_tokens - budget
        total = used + n
        below = max((t for t in self.step_sizes if used < t < total), default=0)
        above = min((t for t in self.step_sizes if t >= total), default=total)
        if below and total - below < above - total and seq.chunk_fit(start, below - used) == below - used:
            n = below - used
        return self._fit(seq, start, n)

    def _fit(self, seq: Sequence, start: int, n: int) -> int:
        """`Sequence.chunk_fit`: n tokens from `start`, cut back before an atomic span; a sequence cut to
        nothing is held (it goes first next step: the module docstring)."""
        fit = seq.chunk_fit(start, n)
        if n and not fit and seq not in self.held:
            self.held.append(seq)
        return fit

    def _start(self, seq: Sequence, now: float) -> None:
        """An admitted sequence's move from waiting to running."""
        if seq.cached_prompt_tokens is None:
            seq.cached_prompt_tokens = seq.num_computed
        if seq.first_scheduled_at is None:
            seq.first_scheduled_at = now
        self.waiting.remove(seq)
        self.running.append(seq)
        seq.status = SeqStatus.RUNNING

    def _admit_pair(self, seq: Sequence, budget: int, slots: int, now: float) -> list[ScheduledChunk]:
        """Admit a CFG main sequence and its shadow together (both prompts must fit), with their first chunks."""
        pair = (seq, seq.shadow)
        needed = sum(self.pool.blocks_needed(s.table, s.all_ids, len(s.all_ids), s.cache_key) for s in pair)
        if needed > self.pool.num_free_blocks - self.reserved_blocks():
            return []
        cached = [self.pool.cached_tokens(s.all_ids, s.cache_key) for s in pair]
        sizes = split_budget(len(seq.all_ids) - cached[0], len(seq.shadow.all_ids) - cached[1], budget, slots)
        if not any(sizes):
            return []
        if not self.pool.allocate(seq.table, seq.all_ids, cached[0] + sizes[0], seq.cache_key):
            return []
        if not self.pool.allocate(seq.shadow.table, seq.shadow.all_ids, cached[1] + sizes[1], seq.cache_key):
            self.pool.free(seq.table)
            return []
        for s in pair:
            s.num_computed = s.table.num_cached_tokens
            s.status = SeqStatus.RUNNING
        if seq.cached_prompt_tokens is None:
            seq.cached_prompt_tokens = seq.num_computed
        if seq.first_scheduled_at is None:
            seq.first_scheduled_at = now
        self.waiting.remove(seq)
        self.running.append(seq)
        return [ScheduledChunk(s, n) for s, n in zip(pair, sizes) if n]

    def _grow_pair(self, seq: Sequence, budget: int, slots: int, scheduled: set[int]) -> list[ScheduledChunk]:
        """A running CFG pair's chunks (runtime/decoding/cfg.py split_budget), growing both; [] if either was preempted."""
        shadow = seq.shadow
        sizes = split_budget(seq.num_tokens - seq.num_computed, shadow.num_tokens - shadow.num_computed,
                             budget, slots)
        scheduled.update((seq.seq_id, shadow.seq_id))   # neither is the other's victim
        out = []
        for s, n in zip((seq, shadow), sizes):
            if n and not self._grow(s, n, scheduled):
                return []   # _grow preempted the pair
            if n:
                out.append(ScheduledChunk(s, n))
        return out

    def reserved_blocks(self) -> int:
        """Blocks promised to running sequences: what they need to finish their prefill, plus one per decode."""
        bs = self.pool.block_size
        total = 0
        for s in self.running + [s.shadow for s in self.running if s.shadow is not None]:
            have = len(s.table.block_ids)
            total += max(0, -(-(s.num_tokens + 1) // bs) - have)
        return total

    def _grow(self, seq: Sequence, n: int, scheduled: set[int]) -> bool:
        """Give `seq` blocks for n more tokens, preempting worse-ranked unscheduled sequences if need be."""
        while not self.pool.allocate(seq.table, seq.all_ids, seq.num_computed + n, seq.cache_key):
            victims = [s for s in self.running if s.seq_id not in scheduled and s is not seq]
            worst = self._victim_rank()
            victim = max(victims, key=worst, default=None)
            if victim is None or worst(victim) < worst(seq):
                self.preempt(seq)
                return False
            self.preempt(victim)
        return True

    def _victim_rank(self) -> Callable[[Sequence], tuple]:
        """How preemption ranks running sequences, worst last: by priority, then (fair) by how many its
        tenant runs, then by arrival, so a burst gives back its own blocks before another tenant's."""
        counts = Counter(s.request.tenant for s in self.running) if self.fair_tenants else Counter()
        return lambda s: (s.request.priority, counts[s.request.tenant], s.arrival)

    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and pins; it waits again and recomputes its KV (output so far kept), or gets
        it back from the host tier when the swapper took it.

        Dropping the cache_prompt pins too keeps two pinned requests from starving each other;
        the engine pins again once the prompt is recomputed. A CFG pair is preempted whole.
        """
        seq = seq.main if seq.main is not None else seq
        self.running.remove(seq)
        if self.swapper is not None:
            self.swapper.swap_out(seq)
        self._release(seq)
        self.pool.unpin(seq.table)
        seq.pinned = False
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._requeue(seq)
        if seq.shadow is not None:
            self._release(seq.shadow)
            seq.shadow.status = SeqStatus.WAITING

    def _requeue(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        seq.num_computed = 0
        if seq not in self.waiting:
            self.waiting.append(seq)
        seq.status = SeqStatus.WAITING

    def _release(self, seq: Sequence) -> None:
        self.pool.free(seq.table)  # pins taken through the table survive until remove()
        seq.num_computed = 0
