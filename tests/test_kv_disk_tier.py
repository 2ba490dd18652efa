"""The disk KV tier wired under the host tier (runtime/kv/kv_staging.py over kv_disk.py): a prefix evicted from the
device and host tiers comes back from disk with the same greedy tokens, a fresh engine over the same model and
directory reuses it, another model never does, API-key partitions hold, and disk reads never hold up other
sequences' steps. Tiny random-weight Llama on CPU; helpers from support/kv_tiers.py."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from imp_jax.runtime.config import EngineConfig
from imp_jax.runtime.kv.kv_staging import attach_disk
from imp_jax.runtime.kv.kv_tiers import host_budget_bytes
from support.kv_tiers import BLOCK_BYTES, FakeLower, random_prompt, run, tier_engine, tier_request

HOST_GIB = 2 * BLOCK_BYTES / (1 << 30)   # a host tier of two blocks: an 80-token prefix overflows to disk


@pytest.fixture(scope="module")
def tiny_loaded(_tiny_hf_template: Path):
    from imp_jax.model.formats.loader import load_model
    return load_model(_tiny_hf_template, dtype="float32")


@pytest.fixture(scope="module")
def plain(tiny_loaded, _tiny_hf_template):
    return tier_engine(tiny_loaded, _tiny_hf_template)


def disk_engine(loaded, path: Path, disk_dir: Path):
    core = tier_engine(loaded, path, kv_host_gib=HOST_GIB, kv_swap_min_tokens=1, kv_disk_dir=str(disk_dir))
    assert attach_disk(core) is not None
    return core


def evict_then_ask(core, shared: list[int], salt: str | None = None, seed: int = 0):
    """Serve `shared`, push it out of the device and host tiers with two other prompts, ask for it again."""
    flow = [[shared + [9]], [random_prompt(seed + 1, 100)], [random_prompt(seed + 2, 100)], [shared + [11, 12]]]
    return [run(core, *[tier_request(p, salt) for p in step]) for step in flow]


def tokens(outs) -> list:
    return [[t for t, _ in step] for step in outs]


def test_a_prefix_evicted_to_disk_comes_back_with_the_same_greedy_tokens(tiny_loaded, _tiny_hf_template, plain,
                                                                           tmp_path):
    plain.pool.reset_prefix_cache()
    core = disk_engine(tiny_loaded, _tiny_hf_template, tmp_path)
    shared = random_prompt(50, 80)
    want, got = evict_then_ask(plain, shared, seed=50), evict_then_ask(core, shared, seed=50)
    assert tokens(got) == tokens(want) and want[-1][0][1] == 0
    stats = core.stats()
    assert got[-1][0][1] == 80 and stats["kv_disk_hits"] >= 3 and stats["kv_disk_writes"] >= 3
    assert stats["kv_disk_reads_inflight"] == 0 and stats["kv_disk_staged_bytes"] == 0
    assert stats["prefix_cache_hits"] >= 80 and stats["kv_disk_bytes_capacity"] == 16 << 30
    core.tiers.close()


def test_a_fresh_engine_over_the_same_model_and_directory_reuses_the_prefixes(tiny_loaded, _tiny_hf_template,
                                                                               plain, tmp_path):
    shared = random_prompt(60, 80)
    first = disk_engine(tiny_loaded, _tiny_hf_template, tmp_path)
    evict_then_ask(first, shared, seed=60)
    first.tiers.close(first.pool)   # engine shutdown: the cached prefixes of every tier go down to disk
    files = first.stats()["kv_disk_files"]
    assert files >= 5
    second = disk_engine(tiny_loaded, _tiny_hf_template, tmp_path)
    assert second.stats()["kv_disk_files"] == files   # found by the start-up scan
    plain.pool.reset_prefix_cache()
    (want, _), = run(plain, tier_request(shared + [11, 12]))
    (got, cached), = run(second, tier_request(shared + [11, 12]))
    assert got == want and cached == 80 and second.stats()["kv_disk_hits"] == 5
    second.tiers.close()


def test_another_model_never_loads_the_first_ones_blocks(tiny_loaded, _tiny_hf_template, tiny_hf_dir, tmp_path):
    from imp_jax.model.formats.loader import load_model
    from tiny_models import write_tiny_hf

    shared = random_prompt(70, 80)
    first = disk_engine(tiny_loaded, _tiny_hf_template, tmp_path)
    evict_then_ask(first, shared, seed=70)
    first.tiers.close()
    write_tiny_hf("LlamaForCausalLM", tiny_hf_dir, seed=1)   # same architecture and shapes, other weights
    other = disk_engine(load_model(tiny_hf_dir, dtype="float32"), tiny_hf_dir, tmp_path)
    assert other.tiers.store.lower.fingerprint != first.tiers.store.lower.fingerprint
    (_, cached), = run(other, tier_request(shared + [11, 12]))
    stats = other.stats()
    assert cached == 0 and stats["kv_disk_hits"] == 0 and stats["kv_disk_files"] == 0
    assert first.tiers.store.lower.stats()["files"] >= 3   # the first model's files stay, in their own directory
    other.tiers.close()


def test_api_key_partitions_hold_on_disk(tiny_loaded, _tiny_hf_template, tmp_path):
    core = disk_engine(tiny_loaded, _tiny_hf_template, tmp_path)
    shared = random_prompt(80, 80)
    evict_then_ask(core, shared, salt="key:a", seed=80)
    core.pool.reset_prefix_cache()   # device and host forget; the disk keeps key a's blocks
    (_, cached_b), = run(core, tier_request(shared + [7], salt="key:b"))
    (_, cached_a), = run(core, tier_request(shared + [7], salt="key:a"))
    assert cached_b == 0 and cached_a == 80
    core.tiers.close()


def lora_disk_engine(path: Path, disk_dir: Path, adapter: Path):
    """A fresh engine (a restart: its own model and slots) with adapter "a" read from `adapter`, over `disk_dir`."""
    from imp_jax.model.formats.loader import load_model
    from imp_jax.model.lora import LoraOptions

    loaded = load_model(path, dtype="float32")
    loaded.model.enable_lora(LoraOptions(2, 8))
    core = tier_engine(loaded, path, max_loras=2, max_lora_rank=8, kv_host_gib=HOST_GIB, kv_swap_min_tokens=1,
                   kv_disk_dir=str(disk_dir))
    assert attach_disk(core) is not None
    core.load_lora("a", core.loras.read(str(adapter)))
    return core


def test_lora_prefixes_on_disk_serve_the_same_adapter_after_a_restart_and_never_another(_tiny_hf_template,
                                                                                        tmp_path):
    from tiny_models import make_adapter

    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    same, other = (make_adapter(_tiny_hf_template, tmp_path / f"ad{seed}", seed, **lora) for seed in (1, 2))
    shared = random_prompt(140, 80) + [11, 12]
    ask = lambda core: run(core, tier_request(shared, lora="a"))[0]
    first = lora_disk_engine(_tiny_hf_template, tmp_path / "disk", same)
    want, cached = ask(first)
    assert cached == 0
    first.tiers.close(first.pool)   # shutdown: its 5 LoRA prefix blocks go down to disk
    assert first.stats()["kv_disk_files"] == 5 and first.stats()["kv_host_not_durable_total"] == 0
    restarted = lora_disk_engine(_tiny_hf_template, tmp_path / "disk", same)
    assert restarted.loras.by_name["a"].digest == first.loras.by_name["a"].digest
    assert ask(restarted) == (want, 80) and restarted.stats()["kv_disk_hits"] == 5
    restarted.tiers.close()
    renamed = lora_disk_engine(_tiny_hf_template, tmp_path / "disk", other)   # same name, other weights
    got, cached = ask(renamed)
    assert cached == 0 and renamed.stats()["kv_disk_hits"] == 0 and got != want
    (_, base_cached), = run(renamed, tier_request(shared))   # nor does the base model read the adapter's blocks
    assert base_cached == 0 and renamed.stats()["kv_disk_hits"] == 0
    renamed.tiers.close()


class SlowLower(FakeLower):
    """A lower store whose reads wait for the test to release them."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def get(self, block_hash):
        assert threading.current_thread() is not threading.main_thread()   # never on the engine's thread
        self.release.wait(10)
        return super().get(block_hash)


def _blocked_read_engine(loaded, template, seed: int):
    """An engine whose disk tier holds an 80-token prefix that has left device and host, and whose next read of
    it blocks until `lower.release` is set: (core, lower, the prefix)."""
    core = tier_engine(loaded, template, kv_host_gib=HOST_GIB, kv_swap_min_tokens=1)
    core.tiers.attach_lower(lower := SlowLower(), core.pool)
    shared = random_prompt(seed, 80)
    lower.release.set()
    evict_then_ask(core, shared, seed=seed)
    core.pool.reset_prefix_cache()
    lower.release.clear()
    return core, lower, shared


def test_a_disk_read_never_holds_up_other_sequences_steps(tiny_loaded, _tiny_hf_template):
    core, lower, shared = _blocked_read_engine(tiny_loaded, _tiny_hf_template, seed=90)
    other, waiter = [], []
    core.add_request(tier_request(random_prompt(95, 20), max_tokens=30), other.append)
    core.add_request(tier_request(shared + [5]), waiter.append)
    for _ in range(10):   # the other request decodes while the waiter's read is blocked
        core.step()
    assert sum(len(e.token_ids) for e in other) >= 5 and not waiter
    assert core.stats()["kv_disk_reads_inflight"] == 1 and core.waiting_for_reads() is False   # others ran
    core.tiers.wake = (woken := threading.Event()).set
    lower.release.set()
    assert woken.wait(10)   # the reader thread tells the engine thread (AsyncEngine: EngineThread.wake)
    while core.has_work():
        core.step()
    assert waiter[-1].usage.cached_tokens == 80 and core.pool.num_free_blocks == core.baseline_free_blocks
    assert core.step_fn.compilations_after_warmup == 0 and core.stats()["kv_disk_staged_bytes"] == 0


def test_the_engine_thread_sleeps_while_its_only_work_is_a_disk_read(tiny_loaded, _tiny_hf_template):
    """With nothing to run but a sequence whose prefix is read from disk, the AsyncEngine's thread waits for a
    command (a landed read posts one) instead of stepping; other requests and stats are still served."""
    import asyncio

    from imp_jax.runtime.core.async_engine import AsyncEngine

    core, lower, shared = _blocked_read_engine(tiny_loaded, _tiny_hf_template, seed=130)
    steps: list[int] = []
    step = core.step
    core.step = lambda: steps.append(ran := step()) or ran
    engine = AsyncEngine(core.config, build=lambda *a, **k: core)

    async def scenario() -> tuple[int, int, int, int]:
        await engine.wait_ready()
        waiter = asyncio.ensure_future(_collect(engine, tier_request(shared + [5])))
        deadline = time.monotonic() + 10
        while engine.stats()["kv_disk_reads_inflight"] == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        before = len(steps)
        await asyncio.sleep(1.0)   # only the read is left: a polling loop would step thousands of times
        idle_steps = len(steps) - before
        other = await _collect(engine, tier_request(random_prompt(131, 20), max_tokens=4))   # a command still wakes it
        assert not waiter.done() and engine.stats()["kv_disk_reads_inflight"] == 1
        lower.release.set()
        done = await asyncio.wait_for(waiter, 30)
        return idle_steps, len(other.token_ids), done.usage.cached_tokens, len(steps)

    engine.start()
    try:
        idle_steps, other_tokens, cached, total = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert idle_steps <= 4 and other_tokens == 4 and cached == 80 and total < 200
    assert core.pool.num_free_blocks == core.baseline_free_blocks and core.stats()["kv_disk_staged_bytes"] == 0


async def _collect(engine, req):
    """A request's events folded into its last one, with every token id."""
    ids: list[int] = []
    async for ev in engine.generate(req):
        ids += ev.token_ids
    ev.token_ids = ids
    return ev


def test_on_a_cpu_a_disk_dir_turns_on_a_small_host_tier_and_multi_host_turns_both_off():
    base = dict(model="m", num_kv_blocks=8)
    assert host_budget_bytes(EngineConfig(**base), "cpu") == 0
    staging = host_budget_bytes(EngineConfig(**base, kv_disk_dir="/x"), "cpu")
    assert 0 < staging <= 1 << 30
    assert host_budget_bytes(EngineConfig(**base, kv_disk_dir="/x", kv_host_gib=0), "cpu") == 0


def test_metrics_expose_the_disk_tier(tiny_loaded, _tiny_hf_template, tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest
    from support.metrics_text import parse, value

    from imp_jax.server.admission import AdmissionGate
    from imp_jax.server.engine_metrics import EngineCollector

    core = disk_engine(tiny_loaded, _tiny_hf_template, tmp_path)
    evict_then_ask(core, random_prompt(100, 80), seed=100)
    registry = CollectorRegistry()
    registry.register(EngineCollector(core.stats, lambda: ("tiny", True), AdmissionGate(), lambda: {}))
    m, stats = parse(generate_latest(registry).decode()), core.stats()
    assert value(m, "imp_kv_disk_tier_hits_total") == stats["kv_disk_hits"] > 0
    assert value(m, "imp_kv_disk_tier_written_bytes_total") == stats["kv_disk_bytes_written"] > 0
    assert value(m, "imp_kv_disk_tier_capacity_bytes") == 16 << 30
    assert value(m, "imp_kv_disk_tier_rejected_total") == 0
    core.tiers.close()


def test_a_directory_others_may_write_is_refused_and_the_engine_serves_without_it(tiny_loaded, _tiny_hf_template,
                                                                                  tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    core = tier_engine(tiny_loaded, _tiny_hf_template, kv_host_gib=HOST_GIB, kv_disk_dir=str(shared))
    assert attach_disk(core) is None and core.tiers.store.lower is None
    (_, cached), = run(core, tier_request(random_prompt(110, 40)))
    assert cached == 0 and not any(shared.iterdir())


def test_engine_shutdown_writes_the_cached_prefixes_to_disk(tiny_loaded, _tiny_hf_template, tmp_path):
    """AsyncEngine.shutdown closes the tiers: a prefix still in the device pool reaches the disk."""
    import asyncio

    from imp_jax.runtime.core.async_engine import AsyncEngine

    core = disk_engine(tiny_loaded, _tiny_hf_template, tmp_path)
    run(core, tier_request(random_prompt(120, 80) + [1]))   # its 5 full blocks stay cached in the pool
    assert core.stats()["kv_disk_files"] == 0
    engine = AsyncEngine(core.config, build=lambda *a, **k: core)
    engine.start()
    asyncio.run(engine.wait_ready())
    engine.shutdown()
    store = core.tiers.store.lower
    assert store.stats()["files"] >= 5 and store.stats()["pending_writes"] == 0
