"""EngineCollector: the engine's own counters, the server's queue and the Responses store, read at scrape time.

The engine core keeps plain ints and `stats()` copies them; nothing here takes a lock the
engine thread could wait on. While the model loads, every series reads 0.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from imp_jax.server.admission import AdmissionGate

# (metric, engine stats key, help); counters get `_total` appended by the exposition
ENGINE_GAUGES = (
    ("imp_queue_waiting", "num_waiting", "Sequences waiting to be scheduled (new or preempted)"),
    ("imp_queue_running", "num_running", "Sequences the scheduler is running"),
    ("imp_kv_blocks_total", "kv_blocks_total", "KV blocks in the pool (the null block excluded)"),
    ("imp_kv_blocks_used", "kv_blocks_used", "KV blocks held by sequences or pinned (cached idle blocks are free)"),
    ("imp_kv_blocks_reserved", "kv_blocks_reserved", "KV blocks promised to running sequences and not yet "
     "written; free minus this is what the next request is admitted against"),
    ("imp_kv_block_size", "kv_block_size", "Tokens per KV block"),
    ("imp_image_rows_total", "image_rows_total", "Rows of the image-encoder output pool (--image-cache-rows; 0: "
     "a text model)"),
    ("imp_image_rows_used", "image_rows_used", "Image-encoder output rows held by running requests"),
    ("imp_decode_batch_last_rows", "decode_batch_last_rows", "Sequences in the most recent decode step; 0 while "
     "the engine idles"),
    ("imp_decode_batch_max", "decode_batch_max", "Most sequences in one decode step since start"),
    ("imp_kv_host_tier_capacity_bytes", "kv_host_bytes_capacity", "Host KV tier budget (--kv-host-gib; 0: off)"),
    ("imp_kv_host_tier_bytes", "kv_host_bytes_used", "Host KV tier bytes held: cached prefix blocks and swapped "
     "sequences"),
    ("imp_kv_host_tier_blocks", "kv_host_blocks", "Prefix blocks cached in the host KV tier"),
    ("imp_kv_host_tier_swapped_sequences", "kv_host_swapped_seqs", "Preempted sequences whose KV waits in "
     "the host tier"),
    ("imp_kv_disk_tier_capacity_bytes", "kv_disk_bytes_capacity", "Disk KV tier budget (--kv-disk-gib; 0: off)"),
    ("imp_kv_disk_tier_bytes", "kv_disk_bytes", "Bytes of block files in the disk KV tier"),
    ("imp_kv_disk_tier_blocks", "kv_disk_files", "Prefix blocks in the disk KV tier"),
    ("imp_kv_disk_tier_reads_inflight", "kv_disk_reads_inflight", "Waiting sequences whose prefix is being read "
     "from the disk tier (off the engine thread)"),
)
ENGINE_COUNTERS = (
    ("imp_prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache at "
     "admission"),
    ("imp_prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache at admission"),
    ("imp_prefix_cache_evictions", "prefix_cache_evictions", "Cached prefix blocks reclaimed for new "
     "allocations"),
    ("imp_prefix_cache_collisions", "prefix_cache_collisions", "Prefix-cache keys that matched a block of "
     "other content (treated as misses)"),
    ("imp_preemptions", "num_preemptions", "Sequences preempted (KV freed, recomputed later)"),
    ("imp_kv_pool_growths", "kv_pool_growths_total", "Times the KV pool committed more memory; stays 0: the "
     "pool is sized once at start-up and never grows"),
    ("imp_kv_host_tier_hits", "kv_lower_tier_hits_total", "Prefix blocks found in the host KV tier (or the "
     "disk tier through it) and copied back instead of recomputed"),
    ("imp_kv_host_tier_misses", "kv_lower_tier_misses_total", "Admissions whose prefix lookup went on past the "
     "device cache into the host tier and ended in a miss"),
    ("imp_kv_host_tier_spills", "kv_host_spills_total", "Prefix blocks evicted from the device cache into the "
     "host tier"),
    ("imp_kv_host_tier_evictions", "kv_host_evictions_total", "Prefix blocks the host tier dropped for room "
     "(handed to the disk tier when there is one)"),
    ("imp_kv_disk_tier_hits", "kv_disk_hits", "Prefix blocks read back (and verified) from the disk KV tier"),
    ("imp_kv_disk_tier_misses", "kv_disk_misses", "Disk KV tier reads that found no usable file"),
    ("imp_kv_disk_tier_read_bytes", "kv_disk_bytes_read", "Bytes read from the disk KV tier"),
    ("imp_kv_disk_tier_written_bytes", "kv_disk_bytes_written", "Bytes written to the disk KV tier"),
    ("imp_kv_disk_tier_writes", "kv_disk_writes", "Block files written to the disk KV tier"),
    ("imp_kv_disk_tier_evictions", "kv_disk_evictions", "Block files the disk KV tier removed for room"),
    ("imp_kv_disk_tier_rejected", "kv_disk_rejected", "Block files rejected on read (torn, corrupt, foreign, "
     "misnamed, links): removed, never served"),
    ("imp_kv_disk_tier_dropped_writes", "kv_disk_dropped_writes", "Blocks not written because the disk tier's "
     "write queue was full (or it was closing)"),
    ("imp_kv_disk_tier_write_errors", "kv_disk_write_errors", "Block writes that failed (disk full, "
     "permissions)"),
    ("imp_kv_disk_tier_skipped", "kv_host_not_durable_total", "Blocks the host tier evicted without writing to "
     "disk: their cache key does not survive a restart (prompt scoring's private blocks)"),
    ("imp_kv_swap_refusals", "kv_swap_refusals_total", "Preempted sequences the host tier had no room for "
     "(they recompute)"),
    ("imp_kv_evicted_tokens", "kv_evicted_tokens_total", "Tokens of cached prefix blocks that left the "
     "server's memory (device with no host copy, or the host tier): a later hit recomputes them"),
    ("imp_kv_pressure_rejections", "kv_pressure_rejections", "Requests refused or ended early because the KV "
     "pool could not hold them"),
    ("imp_decode_batch_rows", "decode_batch_rows_total", "Decode rows summed over decode steps"),
    ("imp_image_row_cache_hits", "image_row_cache_hits_total", "Images whose encoder rows were already in the pool "
     "(sent again: not encoded again)"),
    ("imp_image_encoder_launches", "image_encoder_launches_total", "Vision-encoder program launches (each may "
     "encode several requests' images)"),
    ("imp_image_frames_encoded", "image_frames_encoded_total", "Image frames (tiles and global images; Qwen2.5-VL: whole images) encoded"),
    ("imp_decode_batch_steps", "decode_batch_steps_total", "Steps that ran at least one decode row"),
    ("imp_engine_steps", "num_steps", "Engine steps run"),
    ("imp_engine_steps_failed", "steps_failed_total", "Engine steps that raised (only the requests in them "
     "failed; the engine ran on)"),
    ("imp_compilations_after_warmup", "compilations_after_warmup", "Step programs compiled after warm-up "
     "(0 when the buckets cover the traffic)"),
    ("imp_constrained_steps", "constrained_steps_total", "Steps with at least one structured-output "
     "(grammar-constrained) row"),
    ("imp_constrained_rows", "constrained_rows_total", "Grammar-constrained rows summed over those steps"),
    ("imp_banned_rewinds", "banned_rewinds_total", "banned_strings / banned_regex rewinds: a completed banned "
     "phrase taken back and its first token resampled"),
    ("imp_constraint_mask_seconds", "constraint_mask_seconds_total", "Host seconds computing the "
     "allowed-token masks of constrained rows before each step"),
    # speculative decoding (runtime/decoding/speculative.py): a verify step is one sequence's drafts checked in one
    # engine step; the n-gram matcher is the only drafter, so the aggregate and imp_spec_ngram_* agree
    ("imp_spec_drafted", "spec_drafted_total", "Draft tokens verified"),
    ("imp_spec_accepted", "spec_accepted_total", "Draft tokens accepted"),
    ("imp_spec_verify_steps", "spec_verify_steps_total", "Verify steps (one sequence's drafts in one engine step)"),
    ("imp_spec_miss_steps", "spec_miss_steps_total", "Verify steps that accepted no draft"),
    ("imp_spec_ngram_drafted", "spec_drafted_total", "Draft tokens the n-gram matcher proposed and were verified"),
    ("imp_spec_ngram_accepted", "spec_accepted_total", "n-gram draft tokens accepted"),
    ("imp_spec_ngram_emitted", "spec_emitted_total", "Tokens n-gram verify steps emitted (accepted drafts plus "
     "the token after them)"),
    ("imp_spec_ngram_verify_steps", "spec_verify_steps_total", "n-gram verify steps"),
    ("imp_spec_ngram_verify_wall_ms", "spec_verify_wall_ms_total", "Wall milliseconds of engine steps that "
     "verified drafts, launch to read"),
)

# per replica (label `replica`; "0" alone without --data-parallel-size): (metric, stats key, help, is counter)
REPLICA_SERIES = (
    ("imp_replica_queue_depth", "queue_depth", "Sequences in this replica, running or waiting", False),
    ("imp_replica_kv_blocks_used", "kv_blocks_used", "KV blocks held or pinned in this replica's pool", False),
    ("imp_replica_kv_blocks_total", "kv_blocks_total", "KV blocks in this replica's pool", False),
    ("imp_replica_ready", "ready", "1 while this replica serves (0 loading, suspended by the operator, "
     "faulted)", False),
    ("imp_replica_requests", "requests_total", "Requests this replica admitted", True),
    ("imp_replica_engine_steps", "num_steps", "Engine steps this replica ran", True),
    ("imp_replica_prefix_cache_hits", "prefix_cache_hits", "Prompt tokens this replica found in its prefix "
     "cache", True),
)


def kv_directional(stats: dict[str, Any]) -> Iterator[Metric]:
    """The host KV tier's series with a `direction` label: swaps (imp's imp_kv_swaps_total is direction="out")
    and copy bytes ("out": device -> host, "in": host -> device)."""
    for name, doc, key in (("imp_kv_swaps", "Sequences whose KV moved to the host on preemption (out) and "
                            "back on resumption (in)", "kv_swaps_{}_total"),
                           ("imp_kv_host_tier_copy_bytes", "Bytes copied between the device pool and the host "
                            "KV tier", "kv_host_bytes_{}_total")):
        family = CounterMetricFamily(name, doc, labels=["direction"])
        for direction in ("out", "in"):
            family.add_metric([direction], stats.get(key.format(direction), 0))
        yield family


def replica_series(stats: dict[str, Any]) -> Iterator[Metric]:
    """The REPLICA_SERIES of each replica in `stats` (EngineReplicas: its `replicas`; one engine: itself)."""
    replicas = stats.get("replicas") or [stats]
    families = {name: (CounterMetricFamily if counter else GaugeMetricFamily)(name, doc, labels=["replica"])
                for name, _, doc, counter in REPLICA_SERIES}
    for i, one in enumerate(replicas):
        values = {**one, "queue_depth": int(one.get("num_running", 0)) + int(one.get("num_waiting", 0)),
                  "ready": int(one.get("state") == "ready")}
        for name, key, _, _ in REPLICA_SERIES:
            families[name].add_metric([str(one.get("replica", i))], values.get(key, 0))
    yield from families.values()


class EngineCollector(Collector):
    """Yields the engine, queue, model and store series from callables read at each scrape."""

    def __init__(self, stats: Callable[[], dict[str, Any]], model: Callable[[], tuple[str, bool]],
                 gate: AdmissionGate, store_stats: Callable[[], dict[str, int]]):
        self._stats, self._model, self._gate, self._store_stats = stats, model, gate, store_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        depth = int(stats.get("num_running", 0)) + int(stats.get("num_waiting", 0))
        yield GaugeMetricFamily("imp_queue_depth", "Sequences in the engine, running or waiting", value=depth)
        for name, key, doc in ENGINE_GAUGES:
            yield GaugeMetricFamily(name, doc, value=stats.get(key, 0))
        for name, key, doc in ENGINE_COUNTERS:
            yield CounterMetricFamily(name, doc, value=stats.get(key, 0))
        yield from kv_directional(stats)
        yield from replica_series(stats)
        yield GaugeMetricFamily("imp_queued_requests", "Generation requests submitted and waiting for their "
                                "first token (--max-queued-requests)", value=self._gate.queued_requests)
        yield GaugeMetricFamily("imp_queued_prompt_tokens", "Prompt tokens of the requests waiting for their "
                                "first token, not yet past prefill (--max-queued-tokens)",
                                value=self._gate.queued_tokens)
        name, loaded = self._model()
        model = GaugeMetricFamily("imp_model_loaded", "1 while the named model is loaded and serving", labels=["model"])
        model.add_metric([name], 1 if loaded else 0)
        yield model
        store = self._store_stats()
        yield GaugeMetricFamily("imp_responses_store_entries", "Responses kept for previous_response_id",
                                value=store.get("entries", 0))
        yield GaugeMetricFamily("imp_responses_store_bytes", "JSON bytes of the stored responses",
                                value=store.get("bytes", 0))
        yield CounterMetricFamily("imp_responses_store_evictions", "Stored responses evicted by the entry or "
                                  "byte cap", value=store.get("evictions", 0))
        yield CounterMetricFamily("imp_responses_store_expirations", "Stored responses expired by their TTL",
                                  value=store.get("expirations", 0))
