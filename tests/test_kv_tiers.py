"""The host KV tier (runtime/kv/kv_tiers.py, kv_host.py, kv_copy.py): prefix blocks evicted from a tiny device pool
spill to the host and come back on a hit, preempted sequences swap out and in, a lower (disk) store sits under
the host, and greedy outputs are those of the same engine without the tier. Tiny random-weight Llama on CPU."""
from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from support.kv_tiers import BLOCK_BYTES, FakeLower, random_prompt, run, tier_engine, tier_request

from imp_jax.runtime.core.engine import EngineCore
from imp_jax.runtime.kv.kv_blocks import KVBlockPool
from imp_jax.runtime.kv.kv_hash import (block_preimage, durable_preimage, hash_block, key_bytes, key_from_bytes,
                                     prefix_hashes)
from imp_jax.runtime.kv.kv_host import HostKVStore
from imp_jax.runtime.parallel.sharding import default_mesh



# ------------------------------------------------------------------------------------- host store alone
def test_host_store_evicts_lru_to_the_lower_store_and_never_reads_it():
    lower = FakeLower()
    store = HostKVStore(capacity=2 * 64, lower=lower)
    pres = [block_preimage(None, [i] * 4, "key:abc") for i in range(3)]
    blocks = {hash_block(p): (p, np.full(16, i, np.float32)) for i, p in enumerate(pres)}   # 64 bytes each
    for h, (p, b) in blocks.items():
        store.put(h, p, b)
    first = hash_block(pres[0])
    assert store.num_prefix_blocks == 2 and lower.puts == 1 and first in lower.blocks
    assert store.holds(first, b"anything") and store.stats.evictions == 1   # the lower store is trusted by hash
    assert store.get(first, pres[0]) is None and lower.gets == 0            # never read on the caller's thread
    assert store.get(hash_block(pres[2]), b"other preimage") is None        # a host entry checks the preimage
    assert store.used <= store.capacity


def test_blocks_whose_key_dies_with_the_process_never_reach_the_lower_store():
    """Scoring keys carry a fresh uuid4 (and a LoRA key with a load counter would be per-process): such blocks are
    dropped on eviction (counted), while None, API-key salts and LoRA keys of a content digest go down."""
    lower = FakeLower()
    store = HostKVStore(capacity=64, lower=lower)
    lora = ("key:a", "lora", "ad", "0123abcd")
    keys = [("key:a", "lora", "ad", 1), ("private", "f00", None), ("private", "f00", lora), None, "key:a", lora,
            (None, "lora", "ad", "0123abcd")]
    for i, key in enumerate(keys + [None]):
        pre = block_preimage(None, [i] * 4, key)
        assert key_from_bytes(key_bytes(key) + b"rest") == (key, b"rest")
        assert durable_preimage(pre) == (i > 2)
        store.put(hash_block(pre), pre, np.zeros(16, np.float32))
    assert lower.puts == 4 and store.stats.not_durable == 3 and store.stats.evictions == 7


def test_host_store_refuses_a_swap_it_cannot_hold_and_frees_it_on_take():
    store = HostKVStore(capacity=100)
    store.put(b"h" * 32, b"p", np.zeros(10, np.float32))   # 40 bytes of cache give way to a swap
    assert store.reserve_swap(7, 100) and store.num_prefix_blocks == 0
    assert not store.reserve_swap(8, 1) and store.stats.swap_refusals == 1
    store.put_swap(7, np.ones(25, np.float32))
    assert store.take_swap(7).sum() == 25 and store.used == 0


@pytest.mark.parametrize("host_kind", ["pinned_host", None])
def test_block_copies_gather_and_scatter_any_count_through_fixed_buckets(host_kind):
    """Both host memories: pinned JAX arrays (the gather writes them, the scatter reads them) and numpy; a scatter
    also takes numpy payloads (disk reads) in pinned mode."""
    import jax

    from imp_jax.runtime.kv.kv_copy import BlockCopier, _chunks

    assert _chunks(70) == [(0, 64, 64), (64, 6, 16)] and _chunks(1) == [(0, 1, 1)] and _chunks(0) == []
    rng = np.random.default_rng(0)
    k0, v0 = (rng.standard_normal((2, 80, 2, 2, 4)).astype(np.float32) for _ in range(2))
    kv = (jnp.asarray(k0), jnp.asarray(v0))
    copier = BlockCopier(tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in kv),
                         default_mesh(), host_kind)
    src, dst = list(range(1, 71)), list(range(79, 9, -1))
    blocks = copier.payloads(copier.gather(kv, src))
    assert len(blocks) == 70 and all(b.shape == (2, 2, 2, 2, 4) for b in blocks)
    assert all(isinstance(b, np.ndarray) if host_kind is None else b.sharding.memory_kind == host_kind
               for b in blocks)
    assert np.array_equal(np.asarray(blocks[5]), np.stack([k0[:, 6], v0[:, 6]]))
    blocks[3] = np.asarray(blocks[3])   # a disk read's numpy payload among them
    k1, v1 = (np.asarray(a) for a in copier.scatter(kv, dst, blocks))
    assert np.array_equal(k1[:, dst], k0[:, src]) and np.array_equal(v1[:, dst], v0[:, src])
    assert np.array_equal(k1[:, :10], k0[:, :10])   # nothing else written (padding ids are dropped)


def test_the_host_tier_uses_pinned_host_memory_where_every_device_has_it():
    from types import SimpleNamespace

    from imp_jax.runtime.kv.kv_copy import host_memory_kind

    def mesh(*kinds):
        device = lambda ks: SimpleNamespace(addressable_memories=lambda: [SimpleNamespace(kind=k) for k in ks])
        return SimpleNamespace(devices=np.array([device(ks) for ks in kinds], dtype=object))

    def no_memories():
        raise NotImplementedError("no memory kinds on this backend")

    assert host_memory_kind(mesh(["device", "pinned_host", "unpinned_host"])) == "pinned_host"
    assert host_memory_kind(mesh(["device", "pinned_host"], ["device"])) is None
    assert host_memory_kind(SimpleNamespace(devices=np.array([SimpleNamespace(addressable_memories=no_memories)],
                                                             dtype=object))) is None
    assert host_memory_kind(default_mesh()) == "pinned_host"   # JAX's CPU backend offers it


# ------------------------------------------------------------------------------------- the pool over a tier
class DictTier:
    """A host tier without a device: content is the block's hash, restores are recorded."""

    def __init__(self) -> None:
        self.held: dict[bytes, bytes] = {}
        self.restored: list[tuple[int, bytes]] = []

    def holds(self, h, pre):
        return self.held.get(h) == pre

    def fetch(self, h, pre):
        return h if self.holds(h, pre) else None

    def restore(self, block_id, content):
        self.restored.append((block_id, content))

    def spill(self, block_id, h, pre):
        self.held[h] = pre

    def clear(self):
        self.held.clear()


def _fill(pool: KVBlockPool, tokens: list[int], key=None):
    from imp_jax.runtime.kv.kv_blocks import BlockTable
    table = BlockTable()
    assert pool.allocate(table, tokens, len(tokens), key)
    pool.commit(table, tokens, key)
    return table


def test_pool_spills_evicted_blocks_and_restores_a_host_hit_into_fresh_blocks():
    pool = KVBlockPool(6, 4)
    pool.tier = tier = DictTier()
    a = list(range(17))                       # 4 full blocks + 1
    pool.free(_fill(pool, a, "k"))
    pool.free(_fill(pool, list(range(100, 117)), "k"))   # evicts a's cached blocks into the tier
    assert len(tier.held) >= 4 and pool.stats().evictions >= 4
    assert pool.cached_tokens(a, "k") == 16 and pool.cached_tokens(a, "other") == 0   # partitions stay apart
    table = _fill(pool, a, "k")
    assert table.num_cached_tokens == 16 and len(tier.restored) == 4
    assert [c for _, c in tier.restored] == list(prefix_hashes(a, 4, "k"))
    assert {b for b, _ in tier.restored} == set(table.block_ids[:4])
    assert pool.stats().lower_hits == 4
    pool.free(table)
    assert pool.num_free_blocks == 5


@pytest.fixture(scope="module")
def tiny_loaded(_tiny_hf_template: Path):
    from imp_jax.model.formats.loader import load_model
    return load_model(_tiny_hf_template, dtype="float32")


@pytest.fixture(scope="module")
def plain(tiny_loaded, _tiny_hf_template) -> EngineCore:
    return tier_engine(tiny_loaded, _tiny_hf_template)


@pytest.fixture(scope="module", params=["pinned_host", None])
def tiered(tiny_loaded, _tiny_hf_template, request) -> EngineCore:
    """A host tier holding pinned JAX arrays (what the CPU backend offers), and one holding numpy arrays."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("imp_jax.runtime.kv.kv_tiers.host_memory_kind", lambda mesh: request.param)
        core = tier_engine(tiny_loaded, _tiny_hf_template, kv_host_gib=1 / 1024, kv_swap_min_tokens=1)
    assert core.tiers is not None and core.tiers.copier.host_kind == request.param
    return core


def _reset(*cores: EngineCore) -> None:
    for core in cores:
        core.pool.reset_prefix_cache()


def test_evicted_prefix_comes_back_from_the_host_with_the_same_tokens(plain, tiered):
    """A long shared prefix is pushed out of the tiny pool by other prompts, then asked for again: the tier
    serves it (cached_tokens counts it), the plain engine recomputes it, and the greedy tokens agree."""
    _reset(plain, tiered)
    shared = random_prompt(1, 80)
    flow = [[shared + random_prompt(2, 9)], [random_prompt(3, 100)], [random_prompt(4, 100)], [shared + random_prompt(5, 7)]]
    before = tiered.stats()
    outs = {name: [run(core, *[tier_request(p) for p in step]) for step in flow]
            for name, core in (("plain", plain), ("tiered", tiered))}
    assert [[t for t, _ in s] for s in outs["plain"]] == [[t for t, _ in s] for s in outs["tiered"]]
    assert outs["plain"][-1][0][1] == 0 and outs["tiered"][-1][0][1] == 80
    after = tiered.stats()
    assert after["kv_lower_tier_hits_total"] - before["kv_lower_tier_hits_total"] == 5
    assert after["kv_host_spills_total"] > before["kv_host_spills_total"]
    assert after["kv_host_bytes_in_total"] - before["kv_host_bytes_in_total"] == 5 * BLOCK_BYTES
    kinds = {getattr(p, "sharding", None) and p.sharding.memory_kind for p, _ in tiered.tiers.store._prefix.values()}
    assert kinds == {tiered.tiers.copier.host_kind}   # pinned JAX arrays, or numpy (None)


def test_preempted_sequences_swap_out_and_in_to_the_tokens_they_give_alone(plain, tiered):
    """Three long decodes cannot fit the pool together: the scheduler preempts, the tier swaps them out and
    back in, and each finishes with the tokens it gives alone on the plain engine."""
    _reset(plain, tiered)
    prompts = [random_prompt(10 + i, 60) for i in range(3)]
    alone = [run(plain, tier_request(p, max_tokens=40))[0][0] for p in prompts]
    before = tiered.stats()
    together = run(tiered, *[tier_request(p, max_tokens=40) for p in prompts])
    after = tiered.stats()
    assert [t for t, _ in together] == alone
    assert after["num_preemptions"] > before["num_preemptions"]
    swapped = after["kv_swaps_in_total"] - before["kv_swaps_in_total"]
    assert swapped > 0 and swapped == after["kv_swaps_out_total"] - before["kv_swaps_out_total"]
    assert after["kv_swaps_total"] == after["kv_swaps_in_total"] + after["kv_swaps_out_total"]


def test_api_key_partitions_never_hit_each_others_host_blocks(tiered):
    _reset(tiered)
    shared = random_prompt(20, 80)
    run(tiered, tier_request(shared + [7], salt="key-a"))
    run(tiered, tier_request(random_prompt(21, 100)), tier_request(random_prompt(22, 60)))   # a's blocks leave the device
    before = tiered.stats()["kv_lower_tier_hits_total"]
    (_, cached_b), = run(tiered, tier_request(shared + [7], salt="key-b"))
    assert cached_b == 0 and tiered.stats()["kv_lower_tier_hits_total"] == before
    run(tiered, tier_request(random_prompt(23, 100)), tier_request(random_prompt(24, 60)))
    (_, cached_a), = run(tiered, tier_request(shared + [7], salt="key-a"))
    assert cached_a == 80


def test_a_lower_store_takes_host_evictions_and_serves_them_back(tiny_loaded, _tiny_hf_template, plain):
    """A host tier of 2 blocks hands the rest of an evicted prefix to the lower store, which serves them back."""
    core = tier_engine(tiny_loaded, _tiny_hf_template, kv_host_gib=2 * BLOCK_BYTES / (1 << 30), kv_swap_min_tokens=1)
    core.tiers.attach_lower(lower := FakeLower(), core.pool)
    _reset(plain)
    shared = random_prompt(30, 80)
    flow = [[shared + [9]], [random_prompt(31, 100)], [random_prompt(32, 100)], [shared + [11, 12]]]
    want = [run(plain, *[tier_request(p) for p in step]) for step in flow]
    got = [run(core, *[tier_request(p) for p in step]) for step in flow]
    assert [[t for t, _ in s] for s in got] == [[t for t, _ in s] for s in want]
    assert lower.puts >= 3 and lower.gets >= 1 and got[-1][0][1] == 80
    assert core.stats()["kv_host_lower_hits_total"] >= 1 and core.stats()["kv_disk_puts"] == lower.puts


def test_metrics_expose_the_tier_with_swap_directions(tiered):
    from prometheus_client import CollectorRegistry, generate_latest
    from support.metrics_text import parse, value

    from imp_jax.server.admission import AdmissionGate
    from imp_jax.server.engine_metrics import EngineCollector

    registry = CollectorRegistry()
    registry.register(EngineCollector(tiered.stats, lambda: ("tiny", True), AdmissionGate(), lambda: {}))
    m, stats = parse(generate_latest(registry).decode()), tiered.stats()
    assert value(m, "imp_kv_swaps_total", direction="out") == stats["kv_swaps_out_total"]
    assert value(m, "imp_kv_swaps_total", direction="in") == stats["kv_swaps_in_total"]
    assert value(m, "imp_kv_host_tier_hits_total") == stats["kv_lower_tier_hits_total"]
    assert value(m, "imp_kv_host_tier_capacity_bytes") == tiered.tiers.store.capacity > 0
    assert value(m, "imp_kv_evicted_tokens_total") == stats["kv_evicted_tokens_total"] >= 0


def test_cancelling_a_swapped_out_sequence_frees_its_host_bytes(tiered):
    _reset(tiered)
    reqs = [tier_request(random_prompt(40 + i, 60), max_tokens=40) for i in range(3)]
    for r in reqs:
        tiered.add_request(r, lambda ev: None)
    for _ in range(400):
        tiered.step()
        if tiered.stats()["kv_host_swapped_seqs"]:
            break
    else:
        pytest.fail("no sequence was swapped out")
    for r in reqs:
        tiered.cancel(r.request_id)
    tiered.tiers.land(wait=True)
    assert tiered.stats()["kv_host_swapped_seqs"] == 0 and tiered.tiers.store.swapped_bytes == 0
    while tiered.has_work():
        tiered.step()
    assert tiered.pool.num_free_blocks == tiered.baseline_free_blocks
    assert tiered.tiers.store.used == sum(p.nbytes for p, _ in tiered.tiers.store._prefix.values())
