"""Start-up self-test: a non-XLA kernel runs once on tiny inputs against XLA before the engine trusts it.

A kernel that builds and claims a shape can still fail on a given device (a driver or toolchain that
miscompiles it, a GPU model it was never run on). `select_tested_kernels` makes `select_kernels`' choice,
then runs each chosen non-XLA backend on a tiny batch of the model's own head layout and dtypes (a prefill
and two decodes over a few shuffled pages; with key limits, the prefill's middle tokens attending each other)
and compares it with the XLA oracle. A backend `auto` chose
that fails is replaced by XLA with one warning; one the operator named makes start-up fail.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from imp_jax.kernels_pallas.attention import paged_attention
from imp_jax.kernels_pallas.backends import Kernels, select_kernels
from imp_jax.kernels_pallas.gemm import matmul_wt
from imp_jax.kernels_pallas.kv_cache import BF16_BITS
from imp_jax.kernels_pallas.metadata import AttentionMetadata, AttentionShape
from imp_jax.kernels_pallas.xla.gemm import matmul_wt_xla
from imp_jax.kernels_pallas.xla.oracle import ragged_paged_attention_oracle

log = logging.getLogger("imp_jax.kernels")
# (cached tokens, new tokens) per sequence: a prefill chunk over a cached page, a decode past a page
# edge, a decode of a fresh sequence; then a padding slot and padding tokens
SEQS = ((3, 5), (21, 1), (0, 1))
NUM_TOKENS, NUM_SLOTS = 8, 4
# with `AttentionShape.key_limits`: the first sequence's positions [4, 7) see each other (an image span)
SPAN = (4, 7)
# 16-bit inputs and outputs are rounded to 8 (bf16) or 11 (fp16) mantissa bits along the way
TOLERANCE = {jnp.dtype(jnp.float32): 1e-4, jnp.dtype(jnp.bfloat16): 3e-2, jnp.dtype(jnp.float16): 5e-3}


def select_tested_kernels(device: Any, shape: AttentionShape, *, attention: str = "auto", gemm: str = "auto",
                          quantized: str = "auto", ggml_blocks: bool = False) -> Kernels:
    """`select_kernels`, each non-XLA backend it picks checked on `device` first: one `auto` chose that
    fails falls back to XLA (one warning line); one asked for by name raises ValueError (the operator's
    choice is not silently replaced)."""
    kernels = select_kernels(device, shape, attention=attention, gemm=gemm, quantized=quantized, ggml_blocks=ggml_blocks)
    checks = (("attention", attention, lambda k: _tested(attention_error, device, k, shape)),
              ("gemm", gemm, lambda k: _tested(gemm_error, device, k)))
    for kind, asked, error_of in checks:
        backend = getattr(kernels, kind)
        if backend == "xla":
            continue
        error = error_of(kernels)
        if error is None:
            continue
        if asked != "auto":
            raise ValueError(f"--{kind} {backend}: the start-up self-test failed on this device ({error})")
        log.warning("%s self-test: %s failed on this device (%s); falling back to xla", kind, backend, error)
        kernels = dataclasses.replace(kernels, **{kind: "xla"})
    return kernels


@functools.cache
def _tested(check: Callable[..., str | None], device: Any, kernels: Kernels, *shape: AttentionShape) -> str | None:
    """`check`'s verdict, once per process for each device, kernels and shape: an engine rebuilt alike (a
    model swap, a replica, a test suite's many engines) does not pay its ~0.4 s again."""
    return check(device, kernels, *shape)


def attention_error(device: Any, kernels: Kernels, shape: AttentionShape) -> str | None:
    """None if `kernels.attention` matches the oracle on a tiny batch of `shape` on `device`; else why not,
    in one line (an exception's first line, or the largest difference)."""
    q, k_cache, v_cache, meta, sinks = jax.device_put(tiny_batch(shape), device)
    kw = dict(sm_scale=shape.head_dim ** -0.5, sinks=sinks)
    try:
        got = jax.jit(lambda *a: paged_attention(*a, 0, kernels=kernels, **kw))(q, k_cache, v_cache, meta)
        got = np.asarray(got, np.float32)
    except Exception as e:   # any failure to build, compile or run is a reason to fall back
        return first_line(e)
    want = np.asarray(jax.jit(lambda *a: ragged_paged_attention_oracle(*a, 0, **kw))(q, k_cache, v_cache, meta),
                      np.float32)
    return mismatch(got, want, TOLERANCE.get(jnp.dtype(shape.q_dtype), 3e-2))


def gemm_error(device: Any, kernels: Kernels) -> str | None:
    """None if `kernels.gemm` gives XLA's x @ w.T for float32 and bfloat16 weights (the formats any model
    has) on a few rows on `device`; else why not, in one line."""
    rng = np.random.RandomState(0)
    x = jax.device_put(rng.randn(4, 64).astype(np.float32), device)
    for w in (rng.randn(24, 64).astype(np.float32), rng.randn(24, 64).astype(jnp.bfloat16)):
        w = jax.device_put(w, device)
        try:
            got = np.asarray(jax.jit(lambda x, w: matmul_wt(x, w, kernels))(x, w))
        except Exception as e:
            return first_line(e)
        error = mismatch(got, np.asarray(jax.jit(matmul_wt_xla)(x, w)), 1e-4)
        if error is not None:
            return f"{jnp.dtype(w.dtype).name} weights: {error}"
    return None


def tiny_batch(shape: AttentionShape, seqs: tuple[tuple[int, int], ...] = SEQS, num_tokens: int = NUM_TOKENS,
               num_slots: int = NUM_SLOTS) -> tuple[Any, ...]:
    """(q [T, H, D], one layer of caches [1, NB, BS, KVH, D] in the cache dtype, metadata, sinks or None) for
    `seqs` ((cached, new) tokens each) on shuffled pages of `shape`'s block size, padded to `num_tokens`
    tokens and `num_slots` slots; the step's own K/V is already in the caches. With `shape.key_limits` the
    metadata's key_limit makes the first sequence's positions `SPAN` one bidirectional span."""
    rng = np.random.RandomState(0)
    bs = shape.block_size
    pages = [-(-(start + n) // bs) for start, n in seqs]
    ids = rng.permutation(np.arange(1, sum(pages) + 1))   # block 0 stays the null block
    tables = np.zeros((num_slots, max(pages)), np.int32)
    qsl, seq_lens = np.zeros(num_slots + 1, np.int32), np.zeros(num_slots, np.int32)
    slots = np.full(num_tokens, -1, np.int32)
    used = t = 0
    for s, ((start, n), p) in enumerate(zip(seqs, pages)):
        tables[s, :p] = ids[used:used + p]
        pos = np.arange(start, start + n)
        slots[t:t + n] = tables[s, pos // bs] * bs + pos % bs
        used, t, seq_lens[s] = used + p, t + n, start + n
        qsl[s + 1:] = t
    meta = AttentionMetadata(*(jnp.asarray(a) for a in (qsl, seq_lens, tables, slots, np.int32(len(seqs)))))
    if shape.key_limits:
        start, n = seqs[0]
        limit = np.full(num_tokens, -1, np.int32)
        pos = np.arange(start, start + n)
        limit[:n][(pos >= SPAN[0]) & (pos < SPAN[1])] = SPAN[1] - 1
        meta = dataclasses.replace(meta, key_limit=jnp.asarray(limit))
    cache_shape = (1, len(ids) + 1, bs, shape.num_kv_heads, shape.head_dim)
    k_cache, v_cache = (cache_of(rng.randn(*cache_shape), shape.cache_dtype) for _ in range(2))
    q = jnp.asarray(rng.randn(num_tokens, shape.num_heads, shape.head_dim), shape.q_dtype)
    sinks = jnp.asarray(rng.randn(shape.num_heads), jnp.float32) if shape.sinks else None
    return q, k_cache, v_cache, meta, sinks


def cache_of(values: np.ndarray, dtype: Any) -> jax.Array:
    """`values` stored as a cache of `dtype` (a bfloat16 cache on a CPU is its bits in uint16: kv_cache.py)."""
    if jnp.dtype(dtype) == BF16_BITS:
        return jax.lax.bitcast_convert_type(jnp.asarray(values, jnp.bfloat16), BF16_BITS)
    return jnp.asarray(values, dtype)


def mismatch(got: np.ndarray, want: np.ndarray, tol: float) -> str | None:
    """None when `got` is `want` within `tol` (absolute and relative); else the largest difference."""
    if got.shape != want.shape:
        return f"output shape {got.shape}, expected {want.shape}"
    if np.allclose(got, want, atol=tol, rtol=tol):
        return None
    error = np.nan_to_num(np.abs(got - want), nan=np.inf)   # a NaN is as wrong as it gets
    return f"max abs error {float(error.max()):.3g} > {tol:g}"


def first_line(e: BaseException) -> str:
    """An exception's type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
