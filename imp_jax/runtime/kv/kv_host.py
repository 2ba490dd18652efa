"""The host KV tier's store: block payloads in host memory under a byte budget.

Two kinds of entry share the budget. Prefix blocks, keyed by their chain hash (kv_hash.prefix_hashes:
the partition's extra key is inside the hash, so tenants never share an entry), are a cache: least
recently used first out, handed to the optional `lower` store (the disk tier) as they leave, unless their
key is per-process (kv_hash.durable_preimage). Lower-store blocks come back through
runtime/kv/kv_staging.py, never through `get`. Swapped
sequences' blocks (a preempted sequence's KV, keyed by its seq_id) are held until the sequence resumes
or ends, and are never evicted: a swap that does not fit is refused and the sequence recomputes.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import TYPE_CHECKING, Protocol

import numpy as np

from imp_jax.runtime.kv.kv_hash import durable_preimage

if TYPE_CHECKING:
    from imp_jax.runtime.kv.kv_copy import Payload

BLOCK_PAYLOAD = "[2, num_layers, block_size, num_kv_heads, head_dim]"
"""One block's payload: ONE array of this shape in the cache's storage dtype (kernels_pallas/kv_cache.py
kv_storage_dtype: bfloat16 on a CPU is its bits as uint16), index 0 of the first axis K and 1 V, every layer,
every kv head (the whole head count, also under tensor parallelism). The host store holds a JAX array in
pinned host memory or a numpy array (runtime/kv/kv_copy.py); the lower store is given a C-contiguous numpy array,
keeps bytes, dtype and shape, and gives back an equal numpy array."""


class LowerStore(Protocol):
    """The tier below the host (the disk store): what the host tier calls, and nothing else."""

    def contains(self, block_hash: bytes) -> bool: ...
    def put(self, block_hash: bytes, payload: np.ndarray) -> None: ...     # non-blocking: a queued write
    def get(self, block_hash: bytes) -> np.ndarray | None: ...             # None: missing or corrupt
    def stats(self) -> dict[str, int]: ...


@dataclasses.dataclass
class HostStats:
    """Host-tier counters: blocks unless named otherwise."""

    spills: int = 0         # prefix blocks the device evicted into the host
    evictions: int = 0      # prefix blocks the host dropped for room (handed to `lower` when there is one)
    lower_hits: int = 0     # prefix blocks read back from the lower store (the pool counts every tier's hits)
    not_durable: int = 0    # evicted blocks kept from the lower store: their key is per-process (prompt scoring)
    swaps_out: int = 0      # sequences swapped out (their blocks copied to the host on preemption)
    swaps_in: int = 0       # sequences swapped back in
    swap_refusals: int = 0  # swaps the budget could not hold (those sequences recompute)
    bytes_out: int = 0      # device -> host copy bytes
    bytes_in: int = 0       # host -> device copy bytes


class HostKVStore:
    """Prefix payloads by chain hash (LRU) and swapped sequences' payloads, within `capacity` bytes."""

    def __init__(self, capacity: int, lower: LowerStore | None = None) -> None:
        self.capacity = capacity
        self.lower = lower
        self.used = 0
        self._prefix: OrderedDict[bytes, tuple[Payload, bytes | None]] = OrderedDict()  # oldest first
        self._swapped: dict[int, tuple[int, list[Payload] | None]] = {}   # seq_id -> (bytes reserved, payload)
        self.stats = HostStats()

    @property
    def num_prefix_blocks(self) -> int:
        return len(self._prefix)

    @property
    def swapped_bytes(self) -> int:
        return sum(n for n, _ in self._swapped.values())

    # -- prefix blocks ---------------------------------------------------------------------

    def holds(self, block_hash: bytes, preimage: bytes) -> bool:
        """Whether a lookup of this block would hit here or in the lower store (no read, no LRU move)."""
        entry = self._prefix.get(block_hash)
        if entry is not None:
            return entry[1] is None or entry[1] == preimage
        return self.lower is not None and self.lower.contains(block_hash)

    def get(self, block_hash: bytes, preimage: bytes) -> Payload | None:
        """The block's payload (marked recently used) when the host holds it; None otherwise. Never reads the
        lower store: its blocks are read off the engine thread and held for their admission (runtime/kv/kv_staging.py)."""
        entry = self._prefix.get(block_hash)
        if entry is not None and (entry[1] is None or entry[1] == preimage):
            self._prefix.move_to_end(block_hash)
            return entry[0]
        return None

    def has(self, block_hash: bytes, preimage: bytes) -> bool:
        """Whether the host itself holds the block (not the lower store)."""
        entry = self._prefix.get(block_hash)
        return entry is not None and (entry[1] is None or entry[1] == preimage)

    def put(self, block_hash: bytes, preimage: bytes | None, payload: Payload, to_lower: bool = True) -> None:
        """Keep a prefix block's payload, evicting older ones for room; one larger than the room is dropped."""
        if block_hash in self._prefix:
            self._prefix.move_to_end(block_hash)
            return
        if not self._make_room(payload.nbytes):
            self.stats.evictions += 1   # larger than the whole budget: straight through
            self._hand_down(block_hash, preimage, payload, to_lower)
            return
        self._prefix[block_hash] = (payload, preimage)
        self.used += payload.nbytes

    def _make_room(self, nbytes: int) -> bool:
        """Evict prefix entries, oldest first, until `nbytes` fit; whether they do."""
        while self.used + nbytes > self.capacity and self._prefix:
            h, (payload, pre) = self._prefix.popitem(last=False)
            self.used -= payload.nbytes
            self.stats.evictions += 1
            self._hand_down(h, pre, payload, True)
        return self.used + nbytes <= self.capacity

    def _hand_down(self, block_hash: bytes, preimage: bytes | None, payload: Payload, to_lower: bool) -> None:
        """Give an evicted block to the lower store, if its key means the same after a restart (durable_preimage:
        prompt-scoring blocks stay out) and the store lacks it."""
        if not to_lower or self.lower is None:
            return
        if preimage is None or not durable_preimage(preimage):
            self.stats.not_durable += 1
        elif not self.lower.contains(block_hash):
            self.lower.put(block_hash, np.asarray(payload))   # a pinned JAX array: copied out for the writer

    def hand_down_all(self) -> None:
        """Offer every prefix entry to the lower store, oldest first (shutdown: the disk tier keeps them)."""
        for h, (payload, pre) in self._prefix.items():
            self._hand_down(h, pre, payload, True)

    def clear_prefix(self) -> None:
        """Forget every prefix entry (reset_prefix_cache); swapped sequences stay."""
        self.used -= sum(p.nbytes for p, _ in self._prefix.values())
        self._prefix.clear()

    # -- swapped sequences -----------------------------------------------------------------

    def reserve_swap(self, seq_id: int, nbytes: int) -> bool:
        """Make room for a sequence's swap of `nbytes` (evicting prefix entries); False when it cannot fit."""
        if seq_id in self._swapped or not self._make_room(nbytes):
            self.stats.swap_refusals += 1
            return False
        self._swapped[seq_id] = (nbytes, None)   # the payload comes when its copy lands (put_swap)
        self.used += nbytes
        return True

    def put_swap(self, seq_id: int, payload: list[Payload]) -> None:
        """The swapped blocks (a payload per block) of a reservation, once copied to the host."""
        if seq_id in self._swapped:
            self._swapped[seq_id] = (self._swapped[seq_id][0], payload)

    def take_swap(self, seq_id: int) -> list[Payload] | None:
        """Remove a sequence's swap (resumed or ended), freeing its bytes; its payload if it had landed."""
        nbytes, payload = self._swapped.pop(seq_id, (0, None))
        self.used -= nbytes
        return payload

    def has_swap(self, seq_id: int) -> bool:
        return seq_id in self._swapped
