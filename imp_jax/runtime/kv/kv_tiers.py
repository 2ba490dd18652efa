"""The host KV tier, as the engine sees it: the pool's lower tier and the scheduler's swapper.

The block pool and the scheduler decide (kv_blocks.py: spill an evicted cached block, restore a host hit
into a fresh block; scheduler.py: swap a preempted sequence out, back in when readmitted); this component
queues the copies those decisions need and runs them, in the order they were decided, when the next
program is about to run (`flush`, CompiledStep's hook before every program). Device -> host copies are
gathers whose transfer starts at once and which the host reads when it next flushes and finds them done,
so no step waits on the host; host -> device copies are scatters launched before the step that reads them.
The host store keeps its blocks in pinned host memory where the backend has it (runtime/kv/kv_copy.py).

Swap or recompute (docs/ARCHITECTURE.md, "KV tiers"): a preempted sequence swaps when it has at least
`min_swap_tokens` computed tokens and its blocks fit in the host budget; otherwise it recomputes.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any, Callable


from imp_jax.runtime.kv.kv_copy import BlockCopier, Payload, host_memory_kind
from imp_jax.runtime.kv.kv_host import HostKVStore, LowerStore
from imp_jax.runtime.kv.kv_staging import DiskStaging

if TYPE_CHECKING:
    from imp_jax.runtime.config import EngineConfig
    from imp_jax.runtime.kv.kv_blocks import KVBlockPool
    from imp_jax.runtime.scheduling.sequence import Sequence
    from imp_jax.runtime.execution.step import CompiledStep

log = logging.getLogger("imp_jax.kv_tiers")

# Break-even computed tokens for swap over recompute (docs/ARCHITECTURE.md, "KV tiers": measured with
# scripts/bench_kv_swap.py): below it the copies' fixed cost exceeds a short prefill's.
MIN_SWAP_TOKENS = {"cpu": 16, "gpu": 64}
HOST_SHARE, HOST_CAP = 0.10, 4 << 30   # accelerators' default host budget: min(10% of RAM, 4 GiB)
CPU_STAGING_CAP = 1 << 30              # a CPU's default host budget with --kv-disk-dir: min(10% of RAM, 1 GiB)


def host_budget_bytes(config: EngineConfig, platform: str) -> int:
    """--kv-host-gib in bytes, per engine replica; by default min(10% of RAM, 4 GiB) on an accelerator and 0
    (off) on a CPU, where the device pool is host RAM already and a larger --kv-cache-memory serves better,
    unless --kv-disk-dir asks for a disk tier: then min(10% of RAM, 1 GiB), the disk reads' staging area."""
    if config.multi_host:
        return 0   # the copies are not announced to the other processes (runtime/parallel/multihost.py)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if config.kv_host_gib is not None:
        total = int(config.kv_host_gib * (1 << 30))
    elif platform == "cpu":
        total = min(int(HOST_SHARE * ram), CPU_STAGING_CAP) if config.kv_disk_dir else 0
    else:
        total = min(int(HOST_SHARE * ram), HOST_CAP)
    return max(0, total // config.data_parallel_size)


@dataclasses.dataclass
class _Gather:
    """A dispatched device -> host copy and where its blocks go when they land."""

    blocks: list[Any]                                  # per block, its copy (BlockCopier.gather)
    spills: list[tuple[bytes, bytes]] | None = None   # prefix blocks: (hash, preimage) per block
    seq_id: int = -1                                   # else: a swapped sequence's blocks
    generation: int = 0


class KVTiers:
    """Queues and runs the copies between the device pool and the host store (module docstring)."""

    def __init__(self, step_fn: CompiledStep, store: HostKVStore, min_swap_tokens: int,
                 host_kind: str | None = None):
        self.step_fn = step_fn
        self.store = store
        self.copier = BlockCopier(step_fn.kv_spec, step_fn.mesh, host_kind)   # host_kind: kv_copy.host_memory_kind
        self.block_size = step_fn.kv_spec[0].shape[2]
        self.min_swap_tokens = min_swap_tokens
        self._ops: list[tuple[str, list[int], list]] = []   # queued copies, in decision order (_queue)
        self._inflight: list[_Gather] = []
        self._spilling: dict[bytes, bytes] = {}      # hash -> preimage of spills not landed yet
        self._swapped: dict[int, int] = {}           # seq_id -> computed tokens its swap holds
        self._generation = 0                         # bumped by clear(): older spills are dropped on landing
        self.staging: DiskStaging | None = None      # the disk tier's reads (attach_lower)
        self.wake: Callable[[], None] = _nothing     # any thread: a disk read landed (AsyncEngine: EngineThread.wake)

    @property
    def reading(self) -> int:
        """Sequences whose disk reads are under way (or landed and not yet taken by their admission)."""
        return self.staging.reading if self.staging is not None else 0

    @property
    def inflight_blocks(self) -> int:
        queued = sum(len(ids) for _, ids, _ in self._ops)
        return queued + sum(len(g.blocks) for g in self._inflight)

    def attach_lower(self, lower: LowerStore, pool: KVBlockPool) -> None:
        """Put a store (the disk tier) under the host: evicted prefix blocks go down to it, and admissions read
        them back off the engine thread (runtime/kv/kv_staging.py)."""
        self.store.lower = lower
        one_context = self.step_fn.shapes.max_blocks * self.copier.block_bytes   # the longest prompt always stages
        self.staging = DiskStaging(pool, lower, max(self.store.capacity, one_context), self.copier.block_bytes,
                                   self.in_memory, lambda: self.wake())

    def close(self, pool: KVBlockPool | None = None) -> None:
        """Engine shutdown: stop the reads; with a lower store, offer it the idle cached blocks of `pool` and the
        host tier (so a restart finds them), then wait for its queued writes (bounded: DiskKVStore.close)."""
        if self.staging is not None:
            self.staging.close()
        if pool is not None and self.store.lower is not None:
            for b, h, pre in pool.idle_cached():
                self.spill(b, h, pre)
            self.flush()
            self.land(wait=True)
            self.store.hand_down_all()
        close = getattr(self.store.lower, "close", None)
        if close is not None:
            close()

    # -- the pool's lower tier (kv_blocks.LowerTier) ---------------------------------------

    def in_memory(self, block_hash: bytes, preimage: bytes) -> bool:
        """Whether the host holds the block, or will once its spill lands (no disk read needed)."""
        pending = self._spilling.get(block_hash)
        if pending is not None:
            return pending == preimage
        return self.store.has(block_hash, preimage) or self.staging is not None and self.staging.holds(
            block_hash, preimage)

    def holds(self, block_hash: bytes, preimage: bytes) -> bool:
        if self.staging is not None and self.staging.holds(block_hash, preimage):
            return True
        pending = self._spilling.get(block_hash)
        return pending == preimage if pending is not None else self.store.holds(block_hash, preimage)

    def fetch(self, block_hash: bytes, preimage: bytes) -> Payload | None:
        """The block's payload from host memory (a disk block only once staged for this admission); None: recompute."""
        if block_hash in self._spilling:
            self.flush()
            self.land(wait=True)   # rare: a block evicted and wanted back before its copy landed
        staged = self.staging.take(block_hash, preimage) if self.staging is not None else None
        if staged is not None:
            self.store.stats.lower_hits += 1
            return staged
        return self.store.get(block_hash, preimage)

    def restore(self, block_id: int, content: Payload) -> None:
        self._queue("scatter", [block_id], [content])

    def spill(self, block_id: int, block_hash: bytes, preimage: bytes) -> None:
        self._spilling[block_hash] = preimage
        self._queue("spill", [block_id], [(block_hash, preimage)])

    def clear(self) -> None:
        self._generation += 1
        self._spilling.clear()
        self.store.clear_prefix()

    # -- the scheduler's swapper -------------------------------------------------------------

    def staged(self, seq: Sequence) -> bool:
        """Whether `seq`'s prefix is where admission may take it without a disk read (DiskStaging.ready)."""
        return self.staging is None or self.staging.ready(seq)

    def swap_out(self, seq: Sequence) -> bool:
        """Before `seq`'s blocks are freed on preemption: whether its computed KV is copied to the host (then
        `swapped_tokens` says how much), or it recomputes (the rule says so, or the budget is full)."""
        if self.staging is not None:
            self.staging.forget(seq)   # its next admission looks on disk again
        n = seq.num_computed
        if (n < max(1, self.min_swap_tokens) or seq.shadow is not None or seq.banned is not None
                or "private_cache" in seq.ext):   # CFG pairs, rewinding and scored prompts recompute
            return False
        ids = seq.table.block_ids[:-(-n // self.block_size)]
        if not self.store.reserve_swap(seq.seq_id, len(ids) * self.copier.block_bytes):
            return False
        self._swapped[seq.seq_id] = n
        self._queue("swap", ids, [seq.seq_id])
        self.store.stats.swaps_out += 1
        return True

    def swapped_tokens(self, seq: Sequence) -> int:
        """Computed tokens a swapped-out `seq` gets back from swap_in (0: not swapped)."""
        return self._swapped.get(seq.seq_id, 0)

    def swap_in(self, seq: Sequence) -> None:
        """Copy a swapped `seq`'s KV into the first blocks of its (freshly allocated) table."""
        if any(g.seq_id == seq.seq_id for g in self._inflight) or any(
                kind == "swap" and items == [seq.seq_id] for kind, _, items in self._ops):
            self.flush()
            self.land(wait=True)
        payload = self.store.take_swap(seq.seq_id)
        n = self._swapped.pop(seq.seq_id)
        ids = seq.table.block_ids[:-(-n // self.block_size)]
        self._queue("scatter", ids, list(payload))
        self.store.stats.swaps_in += 1

    def drop(self, seq: Sequence) -> None:
        """Forget a swap (and a disk read) whose sequence ended (or will recompute instead)."""
        if self.staging is not None:
            self.staging.forget(seq)
        if self._swapped.pop(seq.seq_id, None) is not None:
            self.store.take_swap(seq.seq_id)

    # -- running the copies ------------------------------------------------------------------

    def flush(self) -> None:
        """Dispatch the queued copies in order (a run of one kind is one queued op), then land the gathers
        already done. Called before every program, so each copy runs before the program that needs it."""
        ops, self._ops = self._ops, []
        for kind, ids, items in ops:
            if kind == "scatter":
                self.step_fn.kv = self.copier.scatter(self.step_fn.kv, ids, items)
                self.store.stats.bytes_in += sum(p.nbytes for p in items)
                continue
            g = _Gather(self.copier.gather(self.step_fn.kv, ids), generation=self._generation)
            if kind == "spill":
                g.spills = items
            else:
                g.seq_id = items[0]
            self._inflight.append(g)
        self.land()

    def _queue(self, kind: str, ids: list[int], items: list) -> None:
        """Queue a copy ("scatter": payloads into ids; "spill": ids' blocks as (hash, preimage) items; "swap":
        ids' blocks for [seq_id]); a spill or scatter right after one of its kind joins it (one program run)."""
        if self._ops and self._ops[-1][0] == kind != "swap":
            self._ops[-1][1].extend(ids)
            self._ops[-1][2].extend(items)
        else:
            self._ops.append((kind, list(ids), list(items)))

    def land(self, wait: bool = False) -> None:
        """Move finished gathers (all of them with `wait`) into the store, in dispatch order."""
        while self._inflight and (wait or self.copier.landed(self._inflight[0].blocks)):
            g = self._inflight.pop(0)
            blocks = self.copier.payloads(g.blocks)
            self.store.stats.bytes_out += sum(b.nbytes for b in blocks)
            if g.spills is None:
                self.store.put_swap(g.seq_id, blocks)
                continue
            for (h, pre), block in zip(g.spills, blocks):
                if self._spilling.get(h) == pre and g.generation == self._generation:
                    del self._spilling[h]
                    self.store.put(h, pre, block)   # each block is its own buffer (one gather output each)
                    self.store.stats.spills += 1

    def stats(self) -> dict[str, int]:
        s = self.store.stats
        lower = self.store.lower.stats() if self.store.lower is not None else {}
        return dict(kv_host_bytes_capacity=self.store.capacity, kv_host_bytes_used=self.store.used,
                    kv_host_blocks=self.store.num_prefix_blocks, kv_host_swapped_seqs=len(self._swapped),
                    kv_host_inflight_blocks=self.inflight_blocks, kv_host_spilling_blocks=len(self._spilling),
                    kv_host_spills_total=s.spills, kv_host_not_durable_total=s.not_durable,
                    kv_disk_reads_inflight=self.reading,
                    kv_disk_staged_bytes=self.staging.bytes if self.staging is not None else 0,
                    kv_host_evictions_total=s.evictions, kv_host_lower_hits_total=s.lower_hits,
                    kv_swaps_out_total=s.swaps_out, kv_swaps_in_total=s.swaps_in,
                    kv_swap_refusals_total=s.swap_refusals, kv_host_bytes_out_total=s.bytes_out,
                    kv_host_bytes_in_total=s.bytes_in, kv_min_swap_tokens=self.min_swap_tokens,
                    kv_disk_bytes_capacity=int(getattr(self.store.lower, "max_bytes", 0)),
                    **{f"kv_disk_{k}": int(v) for k, v in lower.items()})


def _nothing() -> None:
    """The default `KVTiers.wake`: an engine driven step by step (tests, offline) has nothing to wake."""


def attach_tiers(core: Any, platform: str) -> KVTiers | None:
    """Give an EngineCore a host tier when its budget is above 0: the pool spills and restores through it,
    the scheduler swaps through it, and the step runs its copies before every program."""
    capacity = host_budget_bytes(core.config, platform)
    if capacity <= 0:
        return None
    swap = core.config.kv_swap_min_tokens
    tiers = KVTiers(core.step_fn, HostKVStore(capacity),
                    MIN_SWAP_TOKENS.get(platform, MIN_SWAP_TOKENS["gpu"]) if swap is None else swap,
                    host_memory_kind(core.step_fn.mesh))
    core.pool.tier = tiers
    core.scheduler.swapper = tiers
    core.step_fn.before_programs = tiers.flush
    memory = ("pinned host memory (JAX memory kind pinned_host: copies are DMA inside the copy programs)"
              if tiers.copier.host_kind == "pinned_host" else "pageable host memory (numpy arrays)")
    log.info("KV host tier: %.2f GiB of %s; preempted sequences of >= %d computed tokens swap, shorter ones "
             "recompute", capacity / (1 << 30), memory, tiers.min_swap_tokens)
    return tiers
