"""Start-up: load the model, size and allocate the KV cache, compile every step bucket."""
from __future__ import annotations

import logging
import time
from typing import Callable

import jax
import jax.numpy as jnp

from imp_jax.kernels_pallas import kv_storage_dtype
from imp_jax.model.loader import load_model
from imp_jax.runtime.config import EngineConfig, num_kv_blocks
from imp_jax.runtime.engine import EngineCore

log = logging.getLogger("imp_jax.engine")
Progress = Callable[[str, float], None]   # (phase, fraction done)


def enable_compilation_cache(config: EngineConfig) -> None:
    """JAX's persistent compilation cache on disk, so a restart does not recompile."""
    path = config.cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def build_engine(config: EngineConfig, progress: Progress | None = None) -> EngineCore:
    """A ready EngineCore: model loaded, KV allocated, all buckets compiled (progress logged)."""
    enable_compilation_cache(config)
    progress = progress or (lambda phase, frac: None)
    progress("loading", 0.0)
    loaded = load_model(config.model, dtype=config.dtype, layer_loop=config.layer_loop,
                        model_class=config.model_class)
    backend = jax.default_backend()
    free = None
    if backend != "cpu":
        stats = jax.devices()[0].memory_stats() or {}
        if "bytes_limit" in stats:
            free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    kv_dtype = loaded.dtype if config.kv_cache_dtype == "auto" else jnp.dtype(config.kv_cache_dtype)
    itemsize = jnp.dtype(kv_dtype).itemsize
    blocks = num_kv_blocks(config, loaded.config, itemsize, backend, free)
    shape = loaded.model.kv_cache_shape(blocks, config.block_size)
    kv = tuple(jnp.zeros(shape, kv_storage_dtype(kv_dtype)) for _ in range(2))
    log.info("KV cache: %d blocks of %d tokens, %s (%.0f MiB)", blocks, config.block_size,
             jnp.dtype(kv_dtype).name, 2 * kv[0].size * itemsize / 2**20)
    core = EngineCore(loaded, config, kv, blocks)
    progress("warming_up", 0.0)
    t0 = time.perf_counter()

    def report(i: int, n: int, bucket: tuple[int, int], seconds: float) -> None:
        log.info("compiled step %d/%d (tokens=%d, seqs=%d) in %.1fs", i, n, *bucket, seconds)
        progress("warming_up", i / n)

    core.step_fn.warm_up(report)
    log.info("warm-up done: %d programs in %.1fs", len(core.step_fn.buckets), time.perf_counter() - t0)
    progress("ready", 1.0)
    return core
