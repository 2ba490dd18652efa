"""The engine core's counters and the stats dict /health and /metrics read from another thread."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from imp_jax.runtime.core.engine import EngineCore


@dataclasses.dataclass
class EngineCounters:
    """Plain ints the engine thread bumps and `stats()` reads from any thread (no lock: an int is read whole)."""

    requests: int = 0                # requests admitted (add_request passed)
    kv_pressure_rejections: int = 0  # requests refused or ended early because the pool could not hold them
    decode_steps: int = 0            # steps that ran at least one decode row
    decode_rows: int = 0             # decode rows over those steps
    decode_rows_last: int = 0        # decode rows of the most recent such step
    decode_rows_max: int = 0
    kv_blocks_reserved: int = 0      # blocks promised to running sequences, as of the last step
    mask_steps: int = 0              # steps with at least one grammar-constrained row
    mask_rows: int = 0               # constrained rows over those steps
    mask_seconds: float = 0.0        # host time computing their allowed-token masks (before each launch)
    overlapped_steps: int = 0        # steps launched before the previous step was read (async scheduling)
    banned_rewinds: int = 0          # banned_strings / banned_regex rewinds (a completed phrase resampled)
    spec_drafted: int = 0            # speculative decoding (runtime/decoding/speculative.py): drafts verified
    spec_accepted: int = 0           # of them, accepted
    spec_emitted: int = 0            # tokens verify rows emitted (accepted drafts + the token after them)
    spec_verify_rows: int = 0        # verify rows (one sequence's drafts in one step)
    spec_miss_rows: int = 0          # of them, accepting nothing
    spec_verify_steps: int = 0       # steps with at least one verify row
    spec_verify_seconds: float = 0.0  # their wall time, launch to read
    steps_failed: int = 0            # steps (or sequences' host work) that raised: their requests failed
    requests_failed: int = 0         # requests ended with engine_step_failed

    def count_step(self, decode_rows: int) -> None:
        if decode_rows:
            self.decode_steps += 1
            self.decode_rows += decode_rows
            self.decode_rows_last = decode_rows
            self.decode_rows_max = max(self.decode_rows_max, decode_rows)


def engine_stats(core: EngineCore) -> dict[str, int | float]:
    """Counters and sizes, safe to read from another thread (plain ints; live gauges read 0 when idle)."""
    pc = core.pool.stats()
    c = core.counters
    busy = bool(core.requests)
    free = core.pool.num_free_blocks
    total = core.baseline_free_blocks
    step_fn = core.step_fn
    return dict(num_free_blocks=free, baseline_free_blocks=total,
                num_running=len(core.scheduler.running), num_waiting=len(core.scheduler.waiting),
                num_preemptions=core.scheduler.num_preemptions, num_steps=core.num_steps,
                compilations_after_warmup=step_fn.compilations_after_warmup,
                programs_compiled=step_fn.num_compiled, programs_total=len(step_fn.buckets),
                prefix_cache_queries=pc.queries, prefix_cache_hits=pc.hits,
                prefix_cache_evictions=pc.evictions, prefix_cache_collisions=pc.collisions,
                kv_block_size=core.pool.block_size,
                sessions_open=len(core.sessions), session_pinned_blocks=core.sessions.num_blocks,
                kv_blocks_total=total, kv_blocks_used=total - free, kv_pool_floored=int(core.kv_pool_floored),
                kv_pool_growths_total=0,   # the pool is sized once and never grows (imp_kv_pool_growths_total)
                kv_blocks_reserved=c.kv_blocks_reserved if busy else 0,
                kv_pressure_rejections=c.kv_pressure_rejections, requests_total=c.requests,
                decode_batch_last_rows=c.decode_rows_last if busy else 0,
                decode_batch_rows_total=c.decode_rows, decode_batch_steps_total=c.decode_steps,
                decode_batch_max=c.decode_rows_max, constrained_steps_total=c.mask_steps,
                constrained_rows_total=c.mask_rows, constraint_mask_seconds_total=c.mask_seconds,
                step_host_seconds_total=core.host_seconds, step_device_seconds_total=core.device_seconds,
                overlapped_steps_total=c.overlapped_steps, banned_rewinds_total=c.banned_rewinds,
                spec_drafted_total=c.spec_drafted, spec_accepted_total=c.spec_accepted,
                spec_emitted_total=c.spec_emitted, spec_verify_steps_total=c.spec_verify_rows,
                spec_miss_steps_total=c.spec_miss_rows, spec_verify_wall_ms_total=1000 * c.spec_verify_seconds,
                steps_failed_total=c.steps_failed, requests_failed_total=c.requests_failed,
                **core.by_name["images"].stats(),
                **kv_tier_stats(core, pc))


DISK_KEYS = tuple(f"kv_disk_{k}" for k in ("hits", "misses", "bytes_read", "bytes_written", "writes", "evictions",
                                            "rejected", "dropped_writes", "write_errors", "files", "bytes", "bytes_capacity"))


def kv_tier_stats(core: EngineCore, pc) -> dict[str, int]:
    """The KV tiers' counters (runtime/kv/kv_tiers.py; zeros without a host tier). `kv_evicted_tokens_total`: tokens
    of cached prefix blocks that left the server's memory (evicted from the device with no host copy, or from
    the host tier), so a later hit on them recomputes (or reads the disk tier)."""
    tiers = core.tiers
    out = dict(kv_host_bytes_capacity=0, kv_host_bytes_used=0, kv_host_blocks=0, kv_host_swapped_seqs=0,
               kv_host_inflight_blocks=0, kv_host_spills_total=0, kv_host_evictions_total=0,
               kv_host_lower_hits_total=0, kv_swaps_out_total=0, kv_swaps_in_total=0, kv_swap_refusals_total=0,
               kv_host_bytes_out_total=0, kv_host_bytes_in_total=0, kv_min_swap_tokens=0, kv_host_spilling_blocks=0,
               kv_host_not_durable_total=0, kv_disk_reads_inflight=0, kv_disk_staged_bytes=0, **dict.fromkeys(DISK_KEYS, 0))
    if tiers is not None:
        out.update(tiers.stats())
    out.update(kv_swaps_total=out["kv_swaps_out_total"] + out["kv_swaps_in_total"],
               kv_lower_tier_hits_total=pc.lower_hits, kv_lower_tier_misses_total=pc.lower_misses,
               kv_evicted_tokens_total=core.pool.block_size * (
                   pc.evictions - out["kv_host_spills_total"] - out["kv_host_spilling_blocks"]
                   + out["kv_host_evictions_total"]))
    return out
