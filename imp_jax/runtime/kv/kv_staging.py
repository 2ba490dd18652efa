"""The disk KV tier, as the engine sees it: the store under the host tier, and its reads off the engine thread.

`attach_disk` opens a DiskKVStore (runtime/kv/kv_disk.py) under `--kv-disk-dir/<model fingerprint>` and makes it
the host store's `lower`: blocks the host tier evicts are written there (by the store's writer thread), and
`DiskStaging` reads them back. At admission (Scheduler._admit asks `ready`), a sequence whose prefix lookup
would continue on disk past the device and host tiers hands those reads to one reader thread and waits (not
admitted this step) while every other sequence keeps stepping; once the payloads are in host memory they are
held for it (outside the host tier's LRU, so nothing evicts them first) and it is admitted as a lower-tier hit,
each block copied into a fresh device block. A sequence reads the disk at most once per admission.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from imp_jax.paths import UnsafePathError
from imp_jax.runtime.kv.kv_disk import DiskKVStore
from imp_jax.runtime.kv.kv_fingerprint import model_fingerprint, weights_digest
from imp_jax.runtime.kv.kv_host import BLOCK_PAYLOAD, LowerStore

if TYPE_CHECKING:
    from imp_jax.runtime.core.engine import EngineCore
    from imp_jax.runtime.kv.kv_blocks import KVBlockPool
    from imp_jax.runtime.scheduling.sequence import Sequence

log = logging.getLogger("imp_jax.kv_tiers")

Read = list[tuple[bytes, bytes, np.ndarray]]   # (hash, preimage, payload) of the blocks read, in chain order


class DiskStaging:
    """Reads a waiting sequence's disk-tier blocks on a worker thread and holds them for its admission (module
    docstring). Held payloads and reads under way stay within `capacity` bytes (the host tier's budget, at least one
    longest context's blocks): past it, a sequence is admitted without reading the disk and recomputes them."""

    def __init__(self, pool: KVBlockPool, lower: LowerStore, capacity: int, block_bytes: int,
                 in_memory: Callable[[bytes, bytes], bool], landed: Callable[[], None]) -> None:
        self._pool, self._lower, self.capacity, self.block_bytes = pool, lower, capacity, block_bytes
        self._in_memory = in_memory   # (hash, preimage) -> whether the host holds it or its spill is under way
        self._landed = landed         # called on the reader thread as each read ends (wakes the engine thread)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-read")
        self._reads: dict[int, tuple[Future[Read], int]] = {}      # seq_id -> (its read, bytes reserved)
        self._held: dict[bytes, tuple[bytes, np.ndarray]] = {}      # hash -> (preimage, payload) read, not taken
        self._held_by: dict[int, list[bytes]] = {}                  # seq_id -> the hashes its read brought
        self._checked: set[int] = set()   # sequences that read (or needed nothing) for this admission
        self.bytes = 0                    # held plus reserved

    @property
    def reading(self) -> int:
        return len(self._reads)

    def ready(self, seq: Sequence) -> bool:
        """Whether `seq` may be admitted now: True unless a disk read for its prefix is under way; starts it
        (and answers False) on a sequence's first check when its lookup continues on disk."""
        pending = self._reads.get(seq.seq_id)
        if pending is not None:
            if not pending[0].done():
                return False
            self._hold(seq, *self._reads.pop(seq.seq_id))
            return True
        if seq.seq_id in self._checked:
            return True
        self._checked.add(seq.seq_id)
        wanted = self._on_disk(seq)
        reserve = len(wanted) * self.block_bytes
        if not wanted or self.bytes + reserve > self.capacity:
            return True
        self.bytes += reserve
        read = self._reader.submit(_read, self._lower, wanted)
        self._reads[seq.seq_id] = (read, reserve)
        read.add_done_callback(lambda _: self._landed())
        return False

    def holds(self, block_hash: bytes, preimage: bytes) -> bool:
        entry = self._held.get(block_hash)
        return entry is not None and entry[0] == preimage

    def take(self, block_hash: bytes, preimage: bytes) -> np.ndarray | None:
        """A held payload for the admission that read it (it leaves the staging area: the device has it now)."""
        if not self.holds(block_hash, preimage):
            return None
        _, payload = self._held.pop(block_hash)
        self.bytes -= payload.nbytes
        return payload

    def forget(self, seq: Sequence) -> None:
        """`seq` ended or was preempted: a read under way is dropped, what it held is freed, its next admission
        looks on disk again."""
        pending = self._reads.pop(seq.seq_id, None)
        if pending is not None:
            pending[0].cancel()
            self.bytes -= pending[1]
        for h in self._held_by.pop(seq.seq_id, []):
            entry = self._held.pop(h, None)
            if entry is not None:
                self.bytes -= entry[1].nbytes
        self._checked.discard(seq.seq_id)

    def close(self) -> None:
        self._reader.shutdown(wait=True, cancel_futures=True)

    def _hold(self, seq: Sequence, read: Future[Read], reserved: int) -> None:
        self.bytes -= reserved
        hashes = self._held_by.setdefault(seq.seq_id, [])
        for h, pre, payload in read.result():
            if h not in self._held:
                self._held[h] = (pre, payload)
                self.bytes += payload.nbytes
                hashes.append(h)

    def _on_disk(self, seq: Sequence) -> list[tuple[bytes, bytes]]:
        """(hash, preimage) of the blocks after the device chain that only the lower store holds, up to the first
        block no tier holds."""
        ids, key = seq.all_ids, seq.cache_key
        hit_ids, hashes = self._pool.match_prefix(ids, key)
        chain = self._pool.match_lower(ids, key, len(hit_ids), hashes[-1] if hashes else None)
        return [(h, pre) for h, pre in chain if not self._in_memory(h, pre)]


def _read(lower: LowerStore, wanted: list[tuple[bytes, bytes]]) -> Read:
    """On the reader thread: the blocks' payloads, verified by the store, up to the first miss."""
    out: Read = []
    for h, pre in wanted:
        payload = lower.get(h)
        if payload is None:
            break
        out.append((h, pre, payload))
    return out


def disk_fingerprint(core: EngineCore) -> str:
    """The identity a disk block must match to serve this engine: weights, KV geometry and storage dtype, compute
    dtype, tensor-parallel size, model class, rope as served, payload layout (runtime/kv/kv_fingerprint.py)."""
    loaded, config = core.loaded, core.config
    k = core.step_fn.kv_spec[0]   # [layers, blocks, block_size, kv_heads, head_dim], the whole head count
    layers, _, block_size, kv_heads, head_dim = k.shape
    model_class = config.model_class or f"{type(loaded.model).__module__}.{type(loaded.model).__qualname__}"
    return model_fingerprint(weights_digest(loaded.path), kv_dtype=np.dtype(k.dtype).name, block_size=block_size,
                             num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
                             tp_size=config.tensor_parallel_size, compute_dtype=np.dtype(loaded.dtype).name,
                             model_class=model_class, payload_layout=BLOCK_PAYLOAD,
                             extra={"rope": repr(loaded.config.rope_scaling)})


def disk_budget_bytes(config: Any) -> int:
    """--kv-disk-gib in bytes, per engine replica (each has its own directory: `attach_disk`)."""
    return int(config.kv_disk_gib * (1 << 30)) // config.data_parallel_size


def attach_disk(core: EngineCore, replica: int = 0) -> DiskKVStore | None:
    """With --kv-disk-dir, put a disk store under the engine's host tier (one log line says which rule applied).
    Data-parallel replicas get one directory each (`replica-<i>`): a store's index and LRU budget are its own
    process's, so one writer per directory keeps the budget exact."""
    config = core.config
    if not config.kv_disk_dir:
        return None
    if config.multi_host:
        log.warning("KV disk tier off: --kv-disk-dir is not supported with --num-processes > 1 (no host tier)")
        return None
    if core.tiers is None:
        log.warning("KV disk tier off: it needs the host tier as its staging area (--kv-host-gib 0 turned it off)")
        return None
    root = Path(config.kv_disk_dir).expanduser()
    if config.data_parallel_size > 1:
        root = root / f"replica-{replica}"
    fingerprint = disk_fingerprint(core)
    try:
        store = DiskKVStore(root, fingerprint, disk_budget_bytes(config))
    except (UnsafePathError, OSError) as e:   # another user's or a world-writable directory: never trusted
        log.error("KV disk tier off: %s", e)
        return None
    core.tiers.attach_lower(store, core.pool)
    s = store.stats()
    log.info("KV disk tier: %s/%s, %.2f GiB, %d blocks found (%.0f MiB); staged through a %.2f GiB host tier",
             root, fingerprint, store.max_bytes / (1 << 30), s["files"], s["bytes"] / (1 << 20),
             core.tiers.store.capacity / (1 << 30))
    return store
