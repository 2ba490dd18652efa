"""Block pool bookkeeping: ref counts, prefix hits, LRU eviction, pins and truncate (rewind)."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from imp_jax.runtime.kv.kv_blocks import NULL_BLOCK, BlockTable, KVBlockPool

BS = 4


def admit(pool: KVBlockPool, tokens: list[int], extra_key: str | None = None) -> BlockTable:
    """Allocate a prompt, pretend its KV was written, and commit it."""
    table = BlockTable()
    assert pool.allocate(table, tokens, len(tokens), extra_key)
    pool.commit(table, tokens, extra_key)
    return table


def test_null_block_never_allocated() -> None:
    pool = KVBlockPool(num_blocks=5, block_size=BS)
    table = BlockTable()
    assert pool.allocate(table, list(range(16)), 16)
    assert sorted(table.block_ids) == [1, 2, 3, 4]
    assert NULL_BLOCK not in table.block_ids
    assert pool.num_free_blocks == 0
    assert not pool.allocate(BlockTable(), [1], 1)


def test_allocate_is_all_or_nothing() -> None:
    pool = KVBlockPool(num_blocks=6, block_size=BS)
    table = BlockTable()
    assert pool.allocate(table, list(range(8)), 8)
    before = list(table.block_ids)
    assert not pool.allocate(table, list(range(30)), 30)  # needs 8 blocks, pool has 5
    assert table.block_ids == before
    assert pool.num_free_blocks == 3
    assert pool.allocate(table, list(range(20)), 20)
    assert pool.num_free_blocks == 0


def test_allocate_extends_only_the_missing_blocks() -> None:
    pool = KVBlockPool(num_blocks=10, block_size=BS)
    table = BlockTable()
    assert pool.allocate(table, [1, 2, 3], 3)
    assert pool.blocks_needed(table, [], 4) == 0
    assert pool.blocks_needed(table, [], 5) == 1
    assert pool.allocate(table, [], 9)
    assert len(table.block_ids) == 3


def test_prefix_hit_reuses_blocks() -> None:
    pool = KVBlockPool(num_blocks=16, block_size=BS)
    prompt = list(range(10))  # two full blocks + 2 tokens
    first = admit(pool, prompt)
    assert len(first.block_hashes) == 2
    second = admit(pool, prompt + [99])
    assert second.block_ids[:2] == first.block_ids[:2]
    assert second.block_ids[2] != first.block_ids[2]
    assert second.num_cached_tokens == 8
    assert pool.ref_count(first.block_ids[0]) == 2
    stats = pool.stats()
    assert (stats.queries, stats.hits) == (21, 8)


def test_match_leaves_at_least_one_token_to_compute() -> None:
    pool = KVBlockPool(num_blocks=16, block_size=BS)
    prompt = list(range(8))  # exactly two blocks
    admit(pool, prompt)
    ids, hashes = pool.match_prefix(prompt)
    assert len(ids) == len(hashes) == 1  # the last token's block is recomputed
    assert len(pool.match_prefix(prompt + [8])[0]) == 2
    table = BlockTable()
    assert pool.allocate(table, prompt, 8)
    assert table.num_cached_tokens == 4
    assert len(table.block_ids) == 2


def test_extra_key_and_chain_separate_cache_entries() -> None:
    pool = KVBlockPool(num_blocks=16, block_size=BS)
    prompt = list(range(13))
    admit(pool, prompt, extra_key="adapter-a")
    assert pool.match_prefix(prompt, "adapter-b") == pool.match_prefix(prompt) == ([], [])
    assert len(pool.match_prefix(prompt, "adapter-a")[0]) == 3
    changed = prompt[:5] + [100] + prompt[6:]  # block 1 differs; block 2 matches by tokens only
    assert len(pool.match_prefix(changed, "adapter-a")[0]) == 1


def test_freed_hashed_block_stays_cached_and_unhashed_goes_free() -> None:
    pool = KVBlockPool(num_blocks=8, block_size=BS)
    table = admit(pool, list(range(6)))  # one full (hashed) block + one partial
    full, partial = table.block_ids
    pool.free(table)
    assert table.block_ids == [] and table.block_hashes == []
    assert pool.num_free_blocks == 7
    assert pool.match_prefix(list(range(6)))[0] == [full]
    assert partial in pool._free and full in pool._lru


def test_lru_evicts_least_recently_freed_and_tails_first() -> None:
    pool = KVBlockPool(num_blocks=7, block_size=BS)
    a = admit(pool, list(range(9)))  # blocks a0 a1 hashed + partial
    b = admit(pool, list(range(100, 109)))
    a_ids, b_ids = list(a.block_ids), list(b.block_ids)
    pool.free(a)
    pool.free(b)
    assert list(pool._lru) == [a_ids[1], a_ids[0], b_ids[1], b_ids[0]]
    taker = BlockTable()
    assert pool.allocate(taker, [], 4 * BS)  # 2 free partial blocks, then evicts a1, a0
    assert set(taker.block_ids) == {a_ids[2], b_ids[2], a_ids[1], a_ids[0]}
    assert pool.match_prefix(list(range(9))) == ([], [])
    assert len(pool.match_prefix(list(range(100, 109)))[0]) == 2
    assert pool.stats().evictions == 2


def test_prefix_hit_refreshes_lru_position() -> None:
    pool = KVBlockPool(num_blocks=5, block_size=BS)
    a = admit(pool, list(range(5)))
    b = admit(pool, list(range(100, 105)))
    a0, b0 = a.block_ids[0], b.block_ids[0]
    pool.free(a)
    pool.free(b)
    pool.free(admit(pool, list(range(5))))  # hit on a0 makes it the most recent
    assert list(pool._lru) == [b0, a0]
    taker = BlockTable()
    assert pool.allocate(taker, [], 3 * BS)
    assert b0 in taker.block_ids and a0 not in taker.block_ids


def test_blocks_needed_charges_evictable_hits_only() -> None:
    pool = KVBlockPool(num_blocks=8, block_size=BS)
    prompt = list(range(9))  # 2 cacheable blocks + 1
    live = admit(pool, prompt)
    # Hits on blocks another table holds cost nothing: only the tail block is new.
    assert pool.blocks_needed(BlockTable(), prompt, 9) == 1
    pool.free(live)
    # Hits on evictable blocks take them out of the evictable set.
    assert pool.blocks_needed(BlockTable(), prompt, 9) == 3
    assert pool.blocks_needed(BlockTable(), prompt, 2) == 2  # prefix still covered in full


def test_allocate_succeeds_exactly_when_blocks_needed_fits() -> None:
    pool = KVBlockPool(num_blocks=6, block_size=BS)
    prompt = list(range(9))
    pool.free(admit(pool, prompt))  # 2 evictable blocks, 3 free
    filler = BlockTable()
    assert pool.allocate(filler, [], 2 * BS)  # uses 2 of the 3 free
    assert pool.num_free_blocks == 3
    assert pool.blocks_needed(BlockTable(), prompt, 9) == 3
    table = BlockTable()
    assert pool.allocate(table, prompt, 9)
    assert table.num_cached_tokens == 8 and pool.num_free_blocks == 0
    pool.free(table)
    extra = BlockTable()
    assert pool.allocate(extra, [], BS)  # leaves 2 evictable, 0 free
    assert pool.blocks_needed(BlockTable(), prompt, 9) == 3 > pool.num_free_blocks
    other = BlockTable()
    assert not pool.allocate(other, prompt, 9)
    assert other == BlockTable() and pool.num_free_blocks == 2


def test_commit_duplicate_hash_keeps_existing_block() -> None:
    pool = KVBlockPool(num_blocks=10, block_size=BS)
    prompt = list(range(5))
    a, b = BlockTable(), BlockTable()
    assert pool.allocate(a, prompt, 5) and pool.allocate(b, prompt, 5)  # both computed it
    pool.commit(a, prompt)
    pool.commit(b, prompt)
    assert a.block_hashes == b.block_hashes
    assert a.block_ids[0] != b.block_ids[0]
    assert pool.match_prefix(prompt)[0] == [a.block_ids[0]]
    dup = b.block_ids[0]
    pool.free(b)
    assert dup in pool._free  # the duplicate is not cached
    pool.free(a)
    assert pool.num_free_blocks == 9


def test_commit_is_incremental_and_chains_hashes() -> None:
    pool = KVBlockPool(num_blocks=10, block_size=BS)
    tokens = list(range(3))
    table = BlockTable()
    assert pool.allocate(table, tokens, 3)
    pool.commit(table, tokens)
    assert table.block_hashes == []
    for t in range(3, 13):
        tokens.append(t)
        assert pool.allocate(table, tokens, len(tokens))
        pool.commit(table, tokens)
    assert len(table.block_hashes) == 3
    assert pool.match_prefix(tokens + [0]) == (table.block_ids[:3], table.block_hashes)


def test_pin_blocks_eviction_until_unpinned() -> None:
    pool = KVBlockPool(num_blocks=6, block_size=BS)
    prompt = list(range(9))
    table = admit(pool, prompt)
    pool.pin(table)
    pinned = list(table.pinned_ids)
    assert pinned == table.block_ids[:2]
    pool.free(table)
    assert pool.num_free_blocks == 3  # pinned idle blocks are not allocatable
    hog = BlockTable()
    assert pool.allocate(hog, [], 3 * BS)
    assert not pool.allocate(hog, [], 4 * BS)
    assert pool.match_prefix(prompt)[0] == pinned
    assert pool.blocks_needed(BlockTable(), prompt, 9) == 1  # pinned hits are free of charge
    pool.unpin(table)
    assert pool.num_free_blocks == 2 and list(pool._lru) == pinned[::-1]


def test_pins_nest() -> None:
    pool = KVBlockPool(num_blocks=6, block_size=BS)
    prompt = list(range(5))
    a = admit(pool, prompt)
    b = admit(pool, prompt)
    pool.pin(a)
    pool.pin(b)
    block = a.block_ids[0]
    pool.free(a)
    pool.free(b)
    pool.unpin(a)
    assert block not in pool._lru  # still pinned by b
    pool.unpin(b)
    assert block in pool._lru
    assert pool.num_free_blocks == 5


def test_pin_protects_the_cached_copy_of_a_duplicate() -> None:
    pool = KVBlockPool(num_blocks=6, block_size=BS)
    prompt = list(range(5))
    a, b = BlockTable(), BlockTable()
    assert pool.allocate(a, prompt, 5) and pool.allocate(b, prompt, 5)
    pool.commit(a, prompt)
    pool.commit(b, prompt)
    cached = a.block_ids[0]
    pool.free(a)  # the cached block is now idle
    pool.pin(b)
    assert b.pinned_ids == [cached]
    assert pool.num_free_blocks == 2  # b's two blocks and the pinned idle one are out
    pool.free(b)
    pool.unpin(b)
    assert pool.num_free_blocks == 5


def test_truncate_frees_tail_and_drops_stale_hashes() -> None:
    pool = KVBlockPool(num_blocks=10, block_size=BS)
    tokens = list(range(14))
    table = admit(pool, tokens)  # 3 hashed blocks + partial
    tail = table.block_ids[2:]
    assert pool.truncate(table, 8) is None
    assert len(table.block_ids) == 2 and len(table.block_hashes) == 2
    assert all(pool.ref_count(b) == 0 for b in tail)
    assert pool.num_free_blocks == 7


def test_truncate_into_private_cached_block_uncaches_it() -> None:
    pool = KVBlockPool(num_blocks=10, block_size=BS)
    tokens = list(range(9))
    table = admit(pool, tokens)
    second = table.block_ids[1]
    assert pool.truncate(table, 6) is None
    assert table.block_ids[1] == second and len(table.block_hashes) == 1
    assert len(pool.match_prefix(tokens)[0]) == 1  # its stale hash is gone
    table_tokens = tokens[:6] + [50, 51]
    pool.commit(table, table_tokens)
    assert len(table.block_hashes) == 2
    assert pool.match_prefix(table_tokens + [0])[0] == table.block_ids


def test_truncate_into_shared_block_copies_it() -> None:
    pool = KVBlockPool(num_blocks=10, block_size=BS)
    tokens = list(range(9))
    a = admit(pool, tokens)
    b = admit(pool, tokens)  # shares a's two full blocks
    shared = a.block_ids[1]
    copy = pool.truncate(b, 6)
    assert copy is not None and copy[0] == shared and b.block_ids[1] == copy[1]
    assert pool.ref_count(shared) == 1 and pool.ref_count(copy[1]) == 1
    assert len(pool.match_prefix(tokens)[0]) == 2  # a's cached block is untouched


def test_reset_prefix_cache_forgets_hashes() -> None:
    pool = KVBlockPool(num_blocks=8, block_size=BS)
    prompt = list(range(9))
    live = admit(pool, prompt)
    pool.free(admit(pool, list(range(100, 109))))
    pool.reset_prefix_cache()
    assert pool.match_prefix(prompt) == ([], [])
    assert not pool._lru and pool.num_free_blocks == 4
    pool.free(live)
    assert not pool._lru and pool.num_free_blocks == 7


def test_invalid_pool_size_rejected() -> None:
    with pytest.raises(ValueError):
        KVBlockPool(num_blocks=1, block_size=BS)


class _SimTier:
    """A host tier over the simulator's device: spills copy a block's slots, restores write them back (the
    engine's tier runs its copies, in this order, before the next program: here, at once), LRU within a size."""

    def __init__(self, device: list[list[int | None]], capacity: int) -> None:
        self.device, self.capacity = device, capacity
        self.held: OrderedDict[bytes, tuple[bytes, list]] = OrderedDict()

    def holds(self, h: bytes, pre: bytes) -> bool:
        return h in self.held and self.held[h][0] == pre

    def fetch(self, h: bytes, pre: bytes) -> list | None:
        if not self.holds(h, pre):
            return None
        self.held.move_to_end(h)
        return list(self.held[h][1])

    def restore(self, block_id: int, content: list) -> None:
        self.device[block_id] = list(content)

    def spill(self, block_id: int, h: bytes, pre: bytes) -> None:
        self.held[h] = (pre, list(self.device[block_id]))
        while len(self.held) > self.capacity:
            self.held.popitem(last=False)

    def clear(self) -> None:
        self.held.clear()


class _Sim:
    """Random workload with a fake device cache: slot = hash of the token prefix it encodes."""

    def __init__(self, rng: random.Random, num_blocks: int, host_blocks: int = 0) -> None:
        self.rng = rng
        self.pool = KVBlockPool(num_blocks, BS)
        self.device: list[list[int | None]] = [[None] * BS for _ in range(num_blocks)]
        if host_blocks:
            self.pool.tier = _SimTier(self.device, host_blocks)
        self.seqs: list[tuple[BlockTable, list[int], str | None]] = []
        self.pinned: list[BlockTable] = []
        self.bases = [[rng.randrange(50) for _ in range(24)] for _ in range(3)]

    def write(self, table: BlockTable, tokens: list[int], start: int) -> None:
        for p in range(start, len(tokens)):
            self.device[table.block_ids[p // BS]][p % BS] = hash(tuple(tokens[: p + 1]))

    def copy(self, pair: tuple[int, int] | None) -> None:
        if pair is not None:
            self.device[pair[1]] = list(self.device[pair[0]])

    def step(self) -> None:
        rng, pool = self.rng, self.pool
        op = rng.choice(["admit", "admit", "decode", "decode", "truncate", "free", "pin", "unpin"])
        if rng.random() < 0.01:
            pool.reset_prefix_cache()
        if op == "admit" or not self.seqs:
            base = rng.choice(self.bases)
            prompt = base[: rng.randrange(1, 24)] + [rng.randrange(50) for _ in range(rng.randrange(3))]
            key = rng.choice([None, None, "lora"])
            table = BlockTable()
            needed, free_before = pool.blocks_needed(table, prompt, len(prompt), key), pool.num_free_blocks
            ok = pool.allocate(table, prompt, len(prompt), key)
            assert ok == (needed <= free_before)
            assert pool.num_free_blocks == free_before - (needed if ok else 0)
            if ok:
                assert table.num_cached_tokens < len(prompt)
                self.check_tokens(table, prompt, table.num_cached_tokens)  # prefix hits are right
                self.write(table, prompt, table.num_cached_tokens)
                pool.commit(table, prompt, key)
                self.seqs.append((table, prompt, key))
            return
        i = rng.randrange(len(self.seqs))
        table, tokens, key = self.seqs[i]
        if op == "decode":
            new = [rng.randrange(50) for _ in range(rng.randrange(1, 4))]
            if pool.allocate(table, tokens, len(tokens) + len(new), key):
                start = len(tokens)
                tokens.extend(new)
                self.write(table, tokens, start)
                pool.commit(table, tokens, key)
        elif op == "truncate" and pool.num_free_blocks:
            n = rng.randrange(1, len(tokens) + 1)
            self.copy(pool.truncate(table, n))
            del tokens[n:]
        elif op == "free":
            pool.free(table)
            self.seqs.pop(i)
        elif op == "pin" and table not in self.pinned:
            pool.pin(table)
            self.pinned.append(table)
        elif op == "unpin" and self.pinned:
            pool.unpin(self.pinned.pop(rng.randrange(len(self.pinned))))

    def check_tokens(self, table: BlockTable, tokens: list[int], upto: int) -> None:
        for p in range(upto):
            assert self.device[table.block_ids[p // BS]][p % BS] == hash(tuple(tokens[: p + 1]))

    def check(self) -> None:
        pool = self.pool
        holders = [0] * pool.num_blocks
        for table, tokens, _ in self.seqs:
            assert len(set(table.block_ids)) == len(table.block_ids)
            assert NULL_BLOCK not in table.block_ids
            assert len(table.block_ids) >= pool.num_blocks_for(len(tokens))
            assert len(table.block_hashes) == len(tokens) // BS
            for b in table.block_ids:
                holders[b] += 1
            self.check_tokens(table, tokens, len(tokens))
        for table, tokens, _ in self.seqs:  # a shared block is full wherever it is held
            for j, b in enumerate(table.block_ids):
                if holders[b] > 1:
                    assert (j + 1) * BS <= len(tokens)
        idle = [b for b in range(1, pool.num_blocks) if holders[b] == 0 and pool._pins[b] == 0]
        assert [pool.ref_count(b) for b in range(pool.num_blocks)] == holders
        assert sorted(list(pool._free) + list(pool._lru)) == idle
        assert pool.num_free_blocks == len(idle)
        for h, b in pool._cached.items():
            assert pool._hash[b] == h
        assert all(pool._hash[b] is not None for b in pool._lru)
        assert all(pool._hash[b] is None for b in pool._free)

    def drain(self) -> None:
        for table, _, _ in self.seqs:
            self.pool.free(table)
        for table in self.pinned:
            self.pool.unpin(table)
        self.seqs, self.pinned = [], []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_ops_keep_refcounts_consistent(seed: int) -> None:
    sim = _Sim(random.Random(seed), num_blocks=40)
    for _ in range(500):
        sim.step()
        sim.check()
    sim.drain()
    sim.check()
    assert sim.pool.num_free_blocks == sim.pool.num_blocks - 1
    assert sim.pool.stats().hits > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_ops_with_a_host_tier_serve_the_evicted_content(seed: int) -> None:
    """With a lower tier, evicted cached blocks spill and hits past the device restore them: every prefix hit
    still holds its tokens' content (check_tokens at admission) and the pool's accounting is unchanged."""
    sim = _Sim(random.Random(seed), num_blocks=12, host_blocks=16)
    for _ in range(500):
        sim.step()
        sim.check()
    sim.drain()
    sim.check()
    assert sim.pool.num_free_blocks == sim.pool.num_blocks - 1
    assert sim.pool.stats().lower_hits > 0 and sim.pool.stats().evictions > 0


# -------------------------------------------------------------------- prefix-cache integrity
def test_block_hash_is_sha256_of_a_canonical_preimage() -> None:
    from imp_jax.runtime.kv.kv_hash import block_preimage, hash_block, key_bytes

    pre = block_preimage(None, [1, 2, 3, 4])
    assert len(hash_block(pre)) == 32 and hash_block(pre) == hash_block(block_preimage(None, (1, 2, 3, 4)))
    # distinct inputs that a careless encoding would merge stay distinct
    keys = [None, "", "1", 1, b"1", ("a", "b"), ("ab",), (("a",), "b"), ("a", ("b",)), "é", "\ud800"]
    assert len({key_bytes(k) for k in keys}) == len(keys)
    assert block_preimage(None, [1, 2]) != block_preimage(None, [1 << 32 | 1, 2])
    assert block_preimage(hash_block(pre), [5]) != block_preimage(None, [5])
    with pytest.raises(TypeError):
        key_bytes(1.5)


def test_forced_collision_is_a_miss_not_another_prompts_blocks(monkeypatch) -> None:
    import imp_jax.runtime.kv.kv_blocks as kv_blocks

    monkeypatch.setattr(kv_blocks, "hash_block", lambda preimage: b"\x00" * 32)  # every block collides
    pool = KVBlockPool(num_blocks=16, block_size=BS)
    a = admit(pool, list(range(9)))
    other = list(range(100, 109))
    assert pool.match_prefix(other) == ([], [])
    b = admit(pool, other)
    assert b.num_cached_tokens == 0 and not set(b.block_ids) & set(a.block_ids)
    assert pool.stats().collisions >= 2
    again = admit(pool, list(range(9)))  # the first cached block is still a true hit
    assert again.num_cached_tokens == BS and again.block_ids[0] == a.block_ids[0]


def test_blocks_after_a_collision_are_not_cached(monkeypatch) -> None:
    """A chain whose first hash collided must not register descendants reachable from the other chain."""
    import imp_jax.runtime.kv.kv_blocks as kv_blocks

    real = kv_blocks.hash_block
    a1, b1, x2 = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    b1_pre = kv_blocks.block_preimage(None, b1)
    monkeypatch.setattr(kv_blocks, "hash_block",
                        lambda pre: real(kv_blocks.block_preimage(None, a1)) if pre == b1_pre else real(pre))
    pool = KVBlockPool(num_blocks=16, block_size=BS)
    admit(pool, a1 + [0])                  # caches a1
    b = admit(pool, b1 + x2 + [0])         # b1 collides with a1; x2 after it
    assert b.num_cached_tokens == 0 and b.collision_at == 0
    assert pool.stats().collisions == 2   # one at b's lookup, one at its commit
    probe = admit(pool, a1 + x2 + [0])     # x2's hash here equals b's x2 hash: it must not hit b's block
    assert probe.num_cached_tokens == BS
    assert probe.block_ids[1] != b.block_ids[1]
    pool.pin(b)                            # pins stop at the collision too
    assert b.pinned_ids == []
    pool.free(b)
    assert b.collision_at is None


def test_pin_can_stop_at_a_prefix_of_the_blocks() -> None:
    """cache_prompt_tokens (Anthropic's last cache_control breakpoint) pins only the leading full blocks."""
    pool = KVBlockPool(num_blocks=6, block_size=BS)
    table = admit(pool, list(range(9)))
    pool.pin(table, max_blocks=1)
    assert table.pinned_ids == table.block_ids[:1]
    pool.unpin(table)
    pool.pin(table, max_blocks=0)
    assert table.pinned_ids == []
