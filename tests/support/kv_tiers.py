"""A tiny-pool engine with the host KV tier (tests/test_kv_tiers.py, tests/test_kv_disk_tier.py): its sizes,
an in-memory lower store, and running requests with every tier's invariants checked after."""
from __future__ import annotations

import itertools
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from imp_jax.runtime.config import EngineConfig
from imp_jax.runtime.core.engine import EngineCore
from imp_jax.runtime.request import GenerationRequest, SamplingParams
from imp_jax.runtime.parallel.sharding import default_mesh


BS = 16


POOL = 12            # 11 usable blocks: 176 tokens


BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4   # [2, L=2, BS, KVH=2, D=16] float32


_ids = itertools.count()


class FakeLower:
    """An in-memory stand-in for the disk store: the `lower` interface, counting calls."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, np.ndarray] = {}
        self.puts = self.gets = 0

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self.blocks

    def put(self, block_hash: bytes, payload: np.ndarray) -> None:
        self.puts += 1
        self.blocks[block_hash] = payload.copy()

    def get(self, block_hash: bytes) -> np.ndarray | None:
        self.gets += 1
        return self.blocks.get(block_hash)

    def stats(self) -> dict[str, int]:
        return {"blocks": len(self.blocks), "puts": self.puts, "gets": self.gets}



def tier_engine(loaded, path: Path, **overrides) -> EngineCore:
    config = EngineConfig(model=str(path), max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32,
                          block_size=BS, num_kv_blocks=POOL, **overrides)
    shape = loaded.model.kv_cache_shape(POOL, BS)
    core = EngineCore(loaded, config, (jnp.zeros(shape), jnp.zeros(shape)), POOL, default_mesh())
    core.step_fn.warm_up()
    return core


def tier_request(prompt: list[int], salt: str | None = None, max_tokens: int = 8, lora: str | None = None
             ) -> GenerationRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return GenerationRequest(f"tier-{next(_ids)}", list(prompt), params, cache_salt=salt, lora=lora)


def run(core: EngineCore, *reqs: GenerationRequest) -> list[tuple[list[int], int]]:
    """Run the requests together: each one's (tokens, cached_tokens); every tier at its baseline after."""
    events: list[list] = [[] for _ in reqs]
    for r, ev in zip(reqs, events):
        core.add_request(r, ev.append)
    deadline = time.monotonic() + 120   # by time, not steps: a step waiting for a disk read schedules nothing
    while core.has_work() and time.monotonic() < deadline:
        core.step()
    assert not core.requests and core.pool.num_free_blocks == core.baseline_free_blocks
    if core.tiers is not None:
        core.tiers.land(wait=True)
        stats = core.tiers.stats()
        assert stats["kv_host_swapped_seqs"] == 0 and stats["kv_host_inflight_blocks"] == 0
        assert core.tiers.store.used == sum(p.nbytes for p, _ in core.tiers.store._prefix.values())
        assert core.tiers.store.used <= core.tiers.store.capacity
    assert core.step_fn.compilations_after_warmup == 0
    return [([t for e in ev for t in e.token_ids], ev[-1].usage.cached_tokens) for ev in events]


def random_prompt(seed: int, n: int) -> list[int]:
    return list(np.random.default_rng(seed).integers(4, 250, n))
