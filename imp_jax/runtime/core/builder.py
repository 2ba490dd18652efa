"""Start-up: open the model, choose the kernels for it, build it, size and allocate the KV cache,
compile every step bucket."""
from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp

from imp_jax.errors import ImpError, ModelLoadError
from imp_jax.kernels_pallas import kv_storage_dtype, select_kernels, select_tested_kernels
from imp_jax.kernels_pallas.cpu import build as cpu_kernels
from imp_jax.model.lora import LoraOptions
from imp_jax.model.base import ModelOptions, default_layer_loop
from imp_jax.model.formats.loader import (Checkpoint, LoadedModel, attention_shape, build_model, open_checkpoint,
                                  resolve_dtype)
from imp_jax.model.tensor_parallel import TensorParallel
from imp_jax.paths import COMPILATION_CACHE_MAX_BYTES, UnsafePathError, check_tree, private_dir
from imp_jax.runtime.config import EngineConfig, kv_bytes_per_block, kv_pool_floored, num_kv_blocks
from imp_jax.runtime.core.engine import EngineCore
from imp_jax.runtime.decoding.image_family import family_class
from imp_jax.runtime.kv.kv_staging import attach_disk
from imp_jax.runtime.parallel.multihost import Leader
from imp_jax.runtime.parallel.sharding import kv_sharding, make_mesh, replica_devices
from imp_jax.runtime.execution.weights_fit import fit_on_gpu

log = logging.getLogger("imp_jax.engine")
# image-text families whose images the engine passes (features/images.py); others load their image side and are
# served as text until the engine does their positions (Qwen2.5-VL's M-RoPE: model/vision/qwen2_5_vl.py)
SERVED_VISION = {"idefics3": "Idefics3 / SmolVLM", "qwen2_5_vl": "Qwen2.5-VL", "gemma3": "Gemma 3"}
Progress = Callable[[str, float], None]   # (phase, fraction done)


def enable_compilation_cache(config: EngineConfig) -> None:
    """JAX's persistent compilation cache on disk, so a restart does not recompile. Every entry is checked
    (JAX loads them as native code): one another user owns or could have written turns the cache off."""
    path = config.cache_dir()
    try:
        check_tree(private_dir(path))
    except UnsafePathError as e:   # it holds native code JAX would load: better none than another user's
        log.error("the JAX compilation cache is off: %s", e)
        return
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_compilation_cache_max_size", COMPILATION_CACHE_MAX_BYTES)   # and entries locked
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def build_engine(config: EngineConfig, progress: Progress | None = None,
                 background_compile: bool = False, replica: int = 0) -> EngineCore:
    """A ready EngineCore: model loaded, KV allocated, every program compiled and run once (progress
    logged). With `background_compile`, only the serving set is compiled here; the caller then runs
    `core.step_fn.compile_rest` on another thread (AsyncEngine does) and the first runs when idle.
    `replica` of `config.data_parallel_size` picks the device group (runtime/sharding.replica_devices):
    the weights are built there, not on the first device and then copied."""
    enable_compilation_cache(config)
    progress = progress or (lambda phase, frac: None)
    progress("loading", 0.0)
    try:   # multi-host: the mesh spans every process's devices (runtime/parallel/multihost.py checked the count)
        mesh = make_mesh(jax.devices() if config.multi_host else
                         replica_devices(replica, config.data_parallel_size, config.tensor_parallel_size))
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    device = local_devices(mesh)[0]
    if config.data_parallel_size > 1:
        log.info("replica %d of %d on %s", replica, config.data_parallel_size, device)
    with jax.default_device(device):   # this thread's arrays: the model's weights, LoRA slabs
        # multi-host: every process compiles and runs every program now, in the same order
        core = _build_on(config, progress, background_compile and not config.multi_host, mesh, device, replica)
    if config.multi_host and jax.process_index() == 0:
        core.step_fn.leader = Leader(config.num_processes)   # from now on each program is announced
    return core


def local_devices(mesh) -> list:
    """The mesh's devices this process drives (all of them, unless multi-host)."""
    return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]


def _build_on(config: EngineConfig, progress: Progress, background_compile: bool, mesh, device,
              replica: int = 0) -> EngineCore:
    platform = device.platform
    if platform == "cpu":   # the C++ kernels compile (first start) while the model is fetched and opened
        cpu_kernels.prebuild(cpu_kernels.cpu_libraries(config.attention, config.gemm, config.max_loras > 0))
    ckpt = open_checkpoint(config.model, config.mmproj)
    # longrope (Phi-3/4) picks short or long factors once, from the served context (model/config.py)
    ckpt = dataclasses.replace(ckpt, config=ckpt.config.for_context(config.resolved_max_model_len(ckpt.config)))
    if ckpt.config.rope_scaling.rope_type == "longrope":
        log.info("%s", ckpt.config.describe_rope())
    tp = tensor_parallel_layout(config, ckpt)
    n = config.tensor_parallel_size
    dtype = resolve_dtype(config.dtype, platform)
    kv_dtype = resolve_kv_dtype(config, dtype)
    shape = attention_shape(ckpt.config, dtype, kv_dtype, config.block_size, platform)
    shape = dataclasses.replace(shape, num_heads=tp.local_heads, num_kv_heads=tp.local_kv_heads,   # per shard
                                key_limits=ckpt.vision is not None and family_class(ckpt.vision).bidirectional)
    quantized = config.quantized_weights
    if platform != "cpu" and quantized == "auto":
        fit = fit_on_gpu(ckpt.tensors or {}, itemsize=jnp.dtype(dtype).itemsize, free_bytes=free_device_bytes(mesh),
                         kv_bytes_per_token=kv_bytes_per_block(ckpt.config, 1, jnp.dtype(kv_dtype).itemsize,
                                                               tp.local_kv_heads),
                         max_model_len=config.resolved_max_model_len(ckpt.config), devices=n)
        if fit is not None:
            quantized = fit.choice
            log.info("quantised GGUF matrices: %s (--quantized-weights auto): %s", fit.choice, fit.why)
    choice = dict(attention=config.attention, gemm=config.gemm, quantized=quantized, ggml_blocks=ckpt.ggml_blocks)
    if (config.kv_cache_dtype == "auto" and kv_dtype == jnp.float32
            and select_kernels(device, shape, **choice).gemm == "cpu_q8"):
        kv_dtype = jnp.dtype(jnp.bfloat16)   # llama.cpp's arithmetic, its 16-bit cache too (the reads halve)
        shape = dataclasses.replace(shape, cache_dtype=kv_storage_dtype(kv_dtype, platform))
        log.info("KV cache: bfloat16 (--kv-cache-dtype auto under --gemm cpu_q8, as llama.cpp keeps a 16-bit "
                 "cache; --kv-cache-dtype float32 keeps the model's)")
    kernels = select_tested_kernels(device, shape, **choice)   # self-tested once, on the cache it will read
    log.info("kernels on %s: %s", getattr(device, "device_kind", platform), kernels.describe())
    options = ModelOptions(dtype, config.layer_loop or default_layer_loop(platform), kernels, n)
    loaded = served_vision(build_model(ckpt, options, config.model_class))
    if n > 1:
        log.info("%s", tp.describe(ckpt.config))
        if getattr(loaded.model, "tp", None) != tp:
            raise ModelLoadError(f"--tensor-parallel-size {n}: {type(loaded.model).__name__} does not lay its "
                                 "weights out for tensor parallelism (model/tensor_parallel.py)")
    if config.max_loras:
        if not hasattr(loaded.model, "enable_lora"):
            raise ModelLoadError(f"--max-loras: {type(loaded.model).__name__} has no LoRA support (enable_lora)")
        loaded.model.enable_lora(LoraOptions(config.max_loras, config.max_lora_rank))
    free = free_device_bytes(mesh) if platform != "cpu" else None
    itemsize = jnp.dtype(kv_dtype).itemsize
    blocks = num_kv_blocks(config, loaded.config, itemsize, platform, free, tp.local_kv_heads)
    floored = kv_pool_floored(config, loaded.config, itemsize, platform, free, tp.local_kv_heads)
    if floored:
        log.warning("KV cache: the memory budget pays for less than %d blocks; the pool is floored at %d "
                    "(/health answers 503 kv_pool_floored): free device memory or raise --kv-cache-memory",
                    blocks, blocks)
    kv_shape = loaded.model.kv_cache_shape(blocks, config.block_size)
    zeros = jax.jit(functools.partial(jnp.zeros, kv_shape, kv_storage_dtype(kv_dtype, platform)),
                    out_shardings=kv_sharding(mesh))   # made in place on the mesh, no host copy
    kv = (zeros(), zeros())
    log.info("KV cache: %d blocks of %d tokens, %s (%.0f MiB per device, %d device%s)", blocks, config.block_size,
             jnp.dtype(kv_dtype).name, 2 * kv[0].size * itemsize / 2**20 / n, n, "s" if n > 1 else "")
    core = EngineCore(loaded, config, kv, blocks, mesh)
    log.info("asynchronous scheduling %s (--async-scheduling %s)", "on" if core.async_scheduling else "off",
             config.async_scheduling)
    attach_disk(core, replica)
    core.kv_pool_floored = floored
    core.step_fn.base_seed = config.seed
    log.info("sampling seed %d: requests without a seed draw from it (--seed %d repeats them)", config.seed, config.seed)
    for name, path in config.lora_adapters():
        try:
            core.load_lora(name, core.loras.read(path))
        except ImpError as e:
            raise ModelLoadError(f"--lora {name}={path}: {e.message}") from None
        log.info("LoRA adapter %r loaded from %s", name, path)
    progress("warming_up", 0.0)
    core.by_name["images"].warm_up(lambda i, n, bucket, s: log.info(
        "compiled image encoder %d/%d (%s) in %.1fs", i, n, bucket, s))
    t0 = time.perf_counter()

    def report(i: int, n: int, bucket: tuple[int, int, int], seconds: float) -> None:
        log.info("compiled step %d/%d (tokens=%d, seqs=%d, context blocks=%d) in %.1fs", i, n, *bucket, seconds)
        progress("warming_up", i / n)

    if background_compile:
        core.step_fn.compile_serving_set(report)
        log.info("serving with %d of %d step programs after %.1fs; the rest compile in the background",
                 len(core.step_fn.serving_set()), len(core.step_fn.buckets), time.perf_counter() - t0)
    else:
        core.step_fn.warm_up(report)
        log.info("warm-up done: %d programs in %.1fs", len(core.step_fn.buckets), time.perf_counter() - t0)
    progress("ready", 1.0)
    return core


def resolve_kv_dtype(config: EngineConfig, dtype) -> jnp.dtype:
    """The KV cache's dtype: the model's (bfloat16 on a GPU, `resolve_dtype`) unless --kv-cache-dtype names one
    (`_build_on` then makes `auto` bfloat16 where the GEMM is cpu_q8)."""
    return jnp.dtype(dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype)


def free_device_bytes(mesh) -> int | None:
    """The least free memory any device of the mesh this process drives has; None where devices do not
    report it (CPUs)."""
    free = None
    for d in local_devices(mesh):
        stats = d.memory_stats() or {}
        if "bytes_limit" in stats:
            left = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
            free = left if free is None else min(free, left)
    return free


def served_vision(loaded: LoadedModel) -> LoadedModel:
    """`loaded` as the engine serves it: an image side of a family it does not pass images to yet is dropped
    (the model is served as text, and says so once)."""
    if loaded.vision is None or loaded.vision.family in SERVED_VISION:
        return loaded
    log.info("vision: %s's image side is loaded but the engine passes images to %s only so far: serving it as "
             "text (image parts answer 400 model_not_multimodal)", loaded.config.architecture,
             ", ".join(SERVED_VISION.values()))
    return dataclasses.replace(loaded, vision=None)


def tensor_parallel_layout(config: EngineConfig, ckpt: Checkpoint) -> TensorParallel:
    """How the model splits over --tensor-parallel-size devices; a ModelLoadError for what cannot split."""
    n = config.tensor_parallel_size
    if n > 1:
        flag = f"--tensor-parallel-size {n}"
        if ckpt.kind == "converted":
            raise ModelLoadError(f"{flag}: converted checkpoints are stored for one device; serve the "
                                 "HF directory or GGUF file (not yet)")
        if config.max_loras:
            raise ModelLoadError(f"{flag}: LoRA adapters (--lora, --max-loras) do not run tensor-parallel yet")
        if ckpt.vision is not None:
            raise ModelLoadError(f"{flag}: image-text models do not run tensor-parallel yet; serve "
                                 f"{ckpt.config.architecture} on one device per replica (--data-parallel-size)")
        if ckpt.config.num_heads % ckpt.config.num_kv_heads:
            raise ModelLoadError(f"{flag}: {ckpt.config.num_heads} query heads are not a multiple of "
                                 f"{ckpt.config.num_kv_heads} KV heads")
    return TensorParallel.of(ckpt.config, n)


def compile_in_background(core: EngineCore) -> threading.Thread:
    """Compile the programs `build_engine(background_compile=True)` left, on a daemon thread."""
    def run() -> None:
        t0 = time.perf_counter()
        try:
            core.step_fn.compile_rest(lambda i, n, bucket, s: log.info(
                "compiled step %d/%d (tokens=%d, seqs=%d, context blocks=%d) in the background in %.1fs",
                i, n, *bucket, s))
        except Exception:   # serving goes on with the programs it has
            log.exception("background compilation failed; steps use the larger compiled buckets")
            return
        done, total = core.step_fn.num_compiled, len(core.step_fn.buckets)
        if not core.step_fn.warm:   # shutdown stopped it after the program it was compiling
            log.info("background compilation stopped by shutdown with %d of %d step programs compiled", done, total)
            return
        log.info("warm-up done: all %d step programs compiled, the last in the background after %.1fs",
                 total, time.perf_counter() - t0)

    thread = threading.Thread(target=run, name="imp-compile", daemon=True)
    thread.start()
    return thread
