"""KV block pool: which cache blocks each sequence owns, shared by chained prefix hashes.

Host bookkeeping only. The device cache is `[num_blocks, block_size, kv_heads, head_dim]`
per layer; block 0 is the null block padding points at and is never handed out.
A prefix hit is trusted only after the cached block's whole hash input (parent digest, extra
key, token ids) compares equal, so even a hash collision cannot serve one request another's KV.
With a lower tier (`LowerTier`: the host tier, runtime/kv/kv_tiers.py) an evicted cached block's content is
spilled there, and a lookup continues there where the device chain ends: a hit takes a fresh block and
the tier copies the content back before any program reads it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from imp_jax.runtime.kv.kv_hash import block_key, block_preimage, hash_block

NULL_BLOCK = 0

BlockCopy = tuple[int, int]
"""(src, dst) block ids whose contents the engine must copy on device before the next write."""


class LowerTier(Protocol):
    """Where evicted cached blocks go and come back from; every call is host bookkeeping, the copies it
    queues run before the next program (runtime/kv/kv_tiers.py)."""

    def holds(self, block_hash: bytes, preimage: bytes) -> bool: ...          # a lookup would hit
    def fetch(self, block_hash: bytes, preimage: bytes) -> Any | None: ...    # claim its content
    def restore(self, block_id: int, content: Any) -> None: ...               # copy it into block_id
    def spill(self, block_id: int, block_hash: bytes, preimage: bytes) -> None: ...   # block_id leaves
    def clear(self) -> None: ...                                              # reset_prefix_cache


class OutOfBlocks(RuntimeError):
    """No block left for an operation that cannot wait (truncate, ensure_writable_tail)."""


@dataclass
class BlockTable:
    """One sequence's blocks in order, and the hashes of its committed full blocks."""

    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = 0  # tokens reused from the prefix cache at admission
    pinned_ids: list[int] = field(default_factory=list)  # pins taken via this table; free() keeps them
    collision_at: int | None = None  # first committed block whose hash was cached for other content
    # its row in the device-resident tables (runtime/scheduling/block_tables.py; 0: none yet) and how many leading
    # block_ids that row holds: whatever changes an entry lowers `device_synced` to it
    device_slot: int = 0
    device_synced: int = 0


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters, in tokens (queries, hits: every tier) and blocks (evictions, lower_hits)."""

    queries: int = 0  # prompt tokens looked up at admission
    hits: int = 0  # of those, tokens served from cached blocks
    evictions: int = 0  # cached blocks reclaimed for new allocations
    collisions: int = 0  # lookups or commits whose hash matched a block of different content
    lower_hits: int = 0  # blocks served from the lower tier (host, or disk through it), copied back
    lower_misses: int = 0  # admissions whose lookup went on past the device cache and ended in a miss


class KVBlockPool:
    """Ref-counted block ids; idle hashed blocks stay cached until evicted least-recently-used first.

    A block is in exactly one state: held (refs > 0), pinned idle (refs == 0, pins > 0),
    cached idle (in `_lru`, evictable) or free (in `_free`, no hash).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2 or block_size < 1:
            raise ValueError(f"need num_blocks >= 2 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs = [0] * num_blocks
        self._pins = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks  # set only on the block `_cached` maps to
        self._preimage: list[bytes | None] = [None] * num_blocks  # what `_hash` was taken of, alike
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self._free: deque[int] = deque(range(1, num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._stats = PrefixCacheStats()
        self.tier: LowerTier | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can still get: free plus evictable cached ones."""
        return len(self._free) + len(self._lru)

    def ref_count(self, block_id: int) -> int:
        """How many tables hold `block_id`."""
        return self._refs[block_id]

    def stats(self) -> PrefixCacheStats:
        """A snapshot of the prefix-cache counters."""
        return replace(self._stats)

    def holds(self, block_hash: bytes) -> bool:
        """Whether a block with this hash is cached (held or idle). One dict lookup: a router on another
        thread may ask (replicas.py); the answer may be stale by the time it acts, which costs a miss."""
        return block_hash in self._cached

    def idle_cached(self) -> list[tuple[int, bytes, bytes]]:
        """(block, hash, preimage) of the cached blocks no table holds, least recently used first."""
        return [(b, self._hash[b], self._preimage[b]) for b in self._lru]

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    # -- admission -------------------------------------------------------------------------

    def match_prefix(
        self, token_ids: Sequence[int], extra_key: Hashable = None
    ) -> tuple[list[int], list[bytes]]:
        """Longest chain of cached full blocks for this prompt, as (block_ids, hashes); takes no refs.

        At most (len(token_ids) - 1) // block_size blocks: the last prompt token is always computed.
        A block whose hash matches but whose content differs (a collision) ends the chain: a miss.
        """
        bs = self.block_size
        ids: list[int] = []
        hashes: list[bytes] = []
        parent = None
        for i in range((len(token_ids) - 1) // bs):
            key = block_key(extra_key, i * bs, (i + 1) * bs)
            pre = block_preimage(parent, token_ids[i * bs : (i + 1) * bs], key)
            h = hash_block(pre)
            b = self._cached.get(h)
            if b is None:
                break
            if self._preimage[b] != pre:
                self._stats.collisions += 1
                break
            ids.append(b)
            hashes.append(h)
            parent = h
        return ids, hashes

    def match_lower(self, token_ids: Sequence[int], extra_key: Hashable, start: int,
                    parent: bytes | None) -> list[tuple[bytes, bytes]]:
        """(hash, preimage) of the blocks after the device chain's first `start` (last hash `parent`) that
        the lower tier holds, up to its first miss (or a block the device caches: a chain resumes in one tier)."""
        if self.tier is None:
            return []
        bs, out = self.block_size, []
        for i in range(start, (len(token_ids) - 1) // bs):
            key = block_key(extra_key, i * bs, (i + 1) * bs)
            pre = block_preimage(parent, token_ids[i * bs : (i + 1) * bs], key)
            h = hash_block(pre)
            if h in self._cached or not self.tier.holds(h, pre):
                break
            out.append((h, pre))
            parent = h
        return out

    def cached_tokens(self, token_ids: Sequence[int], extra_key: Hashable = None) -> int:
        """Prompt tokens allocate() on an empty table would serve from the cache: device, then lower tier."""
        ids, hashes = self.match_prefix(token_ids, extra_key)
        lower = self.match_lower(token_ids, extra_key, len(ids), hashes[-1] if hashes else None)
        return (len(ids) + len(lower)) * self.block_size

    def blocks_needed(
        self, table: BlockTable, token_ids: Sequence[int], num_tokens: int, extra_key: Hashable = None
    ) -> int:
        """How much of `num_free_blocks` allocate() would consume; it succeeds iff this <= num_free_blocks.

        Prefix hits are free, except a hit on an evictable block, which leaves the evictable set.
        """
        return self._plan(table, token_ids, num_tokens, extra_key)[2]

    def allocate(
        self, table: BlockTable, token_ids: Sequence[int], num_tokens: int, extra_key: Hashable = None
    ) -> bool:
        """Make `table` cover `num_tokens` tokens, reusing the cached prefix if the table is empty.

        All or nothing: returns False and changes nothing when the pool is short.
        """
        hit_ids, hit_hashes, needed = self._plan(table, token_ids, num_tokens, extra_key)
        if needed > self.num_free_blocks:
            return False
        if not table.block_ids:
            for b in hit_ids:  # before taking new blocks, so these are not the ones evicted
                self._acquire(b)
            table.block_ids = list(hit_ids)
            table.device_synced = 0
            table.block_hashes = list(hit_hashes)
            self._restore_lower(table, token_ids, num_tokens, extra_key)
            table.num_cached_tokens = len(table.block_ids) * self.block_size
            self._stats.queries += len(token_ids)
            self._stats.hits += table.num_cached_tokens
        while len(table.block_ids) < self.num_blocks_for(num_tokens):
            table.block_ids.append(self._take())
        return True

    def _restore_lower(self, table: BlockTable, token_ids: Sequence[int], num_tokens: int,
                       extra_key: Hashable) -> None:
        """Extend a table holding its device prefix hits with the lower tier's hits (at most `num_tokens`
        worth): each gets a fresh block, cached under its hash, that the tier fills before the next program."""
        if self.tier is None:
            return
        parent = table.block_hashes[-1] if table.block_hashes else None
        want = min(self.num_blocks_for(num_tokens), (len(token_ids) - 1) // self.block_size) - len(table.block_ids)
        hits = self.match_lower(token_ids, extra_key, len(table.block_ids), parent)[:max(want, 0)]
        claimed = []
        for h, pre in hits:   # claimed before any block is taken: an eviction's spill may push them out
            content = self.tier.fetch(h, pre)
            if content is None:
                break
            claimed.append((h, pre, content))
        self._stats.lower_hits += len(claimed)
        self._stats.lower_misses += len(claimed) < want
        for h, pre, content in claimed:
            b = self._take()
            self._cached[h], self._hash[b], self._preimage[b] = b, h, pre
            self.tier.restore(b, content)
            table.block_ids.append(b)
            table.block_hashes.append(h)

    def _plan(
        self, table: BlockTable, token_ids: Sequence[int], num_tokens: int, extra_key: Hashable
    ) -> tuple[list[int], list[bytes], int]:
        """Prefix hits (empty table only) and the free-block cost of covering `num_tokens`."""
        hit_ids, hit_hashes = ([], []) if table.block_ids else self.match_prefix(token_ids, extra_key)
        have = len(table.block_ids) or len(hit_ids)
        new = max(0, self.num_blocks_for(num_tokens) - have)
        return hit_ids, hit_hashes, new + sum(1 for b in hit_ids if b in self._lru)

    # -- running sequences -----------------------------------------------------------------

    def commit(self, table: BlockTable, token_ids: Sequence[int], extra_key: Hashable = None) -> None:
        """Hash the table's blocks made full by `token_ids` (every token whose KV is written).

        A hash already cached on another block is only recorded on the table: blocks in use
        are never deduplicated. After a collision (that hash cached for other content) no later
        block of the table is cached, since their hashes descend from an ambiguous one.
        """
        bs = self.block_size
        num_full = min(len(token_ids) // bs, len(table.block_ids))
        parent = table.block_hashes[-1] if table.block_hashes else None
        for i in range(len(table.block_hashes), num_full):
            key = block_key(extra_key, i * bs, (i + 1) * bs)
            pre = block_preimage(parent, token_ids[i * bs : (i + 1) * bs], key)
            h = hash_block(pre)
            b = table.block_ids[i]
            other = self._cached.get(h)
            if other is not None and self._preimage[other] != pre and table.collision_at is None:
                self._stats.collisions += 1
                table.collision_at = i
            if other is None and self._hash[b] is None and table.collision_at is None:
                self._cached[h] = b
                self._hash[b] = h
                self._preimage[b] = pre
            table.block_hashes.append(h)
            parent = h

    def free(self, table: BlockTable) -> None:
        """Drop the table's references, tail first so tails are evicted first, and empty it.

        Pins taken through the table survive: release them with unpin(table).
        """
        for b in reversed(table.block_ids):
            self._release(b)
        table.block_ids = []
        table.device_synced = 0
        table.block_hashes = []
        table.num_cached_tokens = 0
        table.collision_at = None

    def truncate(self, table: BlockTable, num_tokens: int) -> BlockCopy | None:
        """Shorten the table to `num_tokens` tokens (rewind): free tail blocks, drop stale hashes.

        Then makes the new partial tail writable; see ensure_writable_tail for the result. The
        rewind seam of speculative decoding and banned strings, which bring its engine caller
        and the device copy of a shared tail.
        """
        keep = self.num_blocks_for(num_tokens)
        for b in reversed(table.block_ids[keep:]):
            self._release(b)
        del table.block_ids[keep:]
        table.device_synced = min(table.device_synced, keep)
        self._drop_hashes(table, num_tokens // self.block_size)
        table.num_cached_tokens = min(table.num_cached_tokens, num_tokens)
        return self.ensure_writable_tail(table, num_tokens)

    def ensure_writable_tail(self, table: BlockTable, num_tokens: int) -> BlockCopy | None:
        """Make the partial block holding token `num_tokens` private before it is written again.

        A block only this table holds just leaves the prefix cache; a shared or pinned one is
        replaced by a fresh block and the (src, dst) device copy returned. Raises OutOfBlocks.
        """
        i, partial = divmod(num_tokens, self.block_size)
        if not partial or i >= len(table.block_ids):
            return None  # the next token opens a new block
        self._drop_hashes(table, i)
        b = table.block_ids[i]
        if self._refs[b] == 1 and self._pins[b] == 0:
            if self._hash[b] is not None:
                self._uncache(b)
            return None
        if self.num_free_blocks == 0:
            raise OutOfBlocks("no free block to copy a shared tail into")
        dst = self._take()
        table.block_ids[i] = dst
        table.device_synced = min(table.device_synced, i)
        self._release(b)
        return b, dst

    # -- prompt caching --------------------------------------------------------------------

    def pin(self, table: BlockTable, max_blocks: int | None = None) -> None:
        """Keep the cached blocks of the table's committed hashes (the first `max_blocks` of them when given)
        from eviction until unpin(table).

        Pins nest: a block stays pinned while any pin on it is held.
        """
        for i, h in enumerate(table.block_hashes[:max_blocks]):
            if i == table.collision_at:
                break
            b = self._cached.get(h)
            if b is None:
                continue
            if self._refs[b] == 0 and self._pins[b] == 0:
                del self._lru[b]
            self._pins[b] += 1
            table.pinned_ids.append(b)

    def unpin(self, table: BlockTable) -> None:
        """Release every pin taken through `table`."""
        self.unpin_blocks(table.pinned_ids)
        table.pinned_ids = []

    def unpin_blocks(self, block_ids: list[int]) -> None:
        """Release one pin on each of `block_ids` (pins taken by pin())."""
        for b in reversed(block_ids):
            self._pins[b] -= 1
            self._park_if_idle(b)

    def reset_prefix_cache(self) -> None:
        """Forget every block hash; idle cached blocks become free. Live tables keep their blocks."""
        for b in self._cached.values():
            self._hash[b] = None
            self._preimage[b] = None
        self._cached.clear()
        self._free.extend(self._lru)
        self._lru.clear()
        if self.tier is not None:
            self.tier.clear()

    # -- block states ----------------------------------------------------------------------

    def _take(self) -> int:
        """A fresh block with one reference: from the free list, else the LRU cached block."""
        if self._free:
            b = self._free.popleft()
        else:
            b, _ = self._lru.popitem(last=False)
            if self.tier is not None:
                self.tier.spill(b, self._hash[b], self._preimage[b])
            self._uncache(b)
            self._stats.evictions += 1
        self._refs[b] = 1
        return b

    def _acquire(self, b: int) -> None:
        if self._refs[b] == 0 and self._pins[b] == 0:
            del self._lru[b]  # an idle cached block is reused
        self._refs[b] += 1

    def _release(self, b: int) -> None:
        self._refs[b] -= 1
        self._park_if_idle(b)

    def _park_if_idle(self, b: int) -> None:
        """An unheld, unpinned block becomes evictable (most recent) if hashed, else free."""
        if self._refs[b] == 0 and self._pins[b] == 0:
            if self._hash[b] is None:
                self._free.append(b)
            else:
                self._lru[b] = None

    def _uncache(self, b: int) -> None:
        del self._cached[self._hash[b]]
        self._hash[b] = None
        self._preimage[b] = None

    @staticmethod
    def _drop_hashes(table: BlockTable, keep: int) -> None:
        """Forget the table's hashes from block `keep` on (their blocks are rewritten or gone)."""
        del table.block_hashes[keep:]
        if table.collision_at is not None and table.collision_at >= keep:
            table.collision_at = None
