"""Ragged paged attention for x86-64 CPUs (attention.cc), called as an XLA FFI custom call.

Same contract and results (to float32 rounding) as the XLA backend, but each query token reads
its keys and values once, straight from the paged cache, instead of the gathered copies XLA's
einsums need: several times faster on decode steps. It takes float32 queries over float32 or
bfloat16 caches (`--kv-cache-dtype`) with a head_dim that is a multiple of 8. Built on first use
(build.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from imp_jax.kernels_pallas.cpu import build
from imp_jax.kernels_pallas.kv_cache import BF16_BITS
from imp_jax.kernels_pallas.metadata import AttentionMetadata, AttentionShape

TARGET = "imp_ragged_paged_attention_f32"


def available() -> bool:
    """Whether the kernel is built, loaded and registered for this CPU (built on the first call)."""
    return build.register("attention", TARGET, "ImpRaggedPagedAttentionF32")


def supports(shape: AttentionShape) -> bool:
    """Whether the kernel takes a model of this shape: float32 queries over float32 or bfloat16
    caches (or bfloat16 bits in uint16, `kv_cache.kv_storage_dtype`), head_dim a multiple of 8."""
    return (shape.q_dtype == jnp.float32 and shape.head_dim % 8 == 0
            and shape.cache_dtype in (jnp.float32, jnp.bfloat16, jnp.dtype(BF16_BITS)))


def ragged_paged_attention_cpu(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, meta: AttentionMetadata,
    layer: jax.Array | int, *, sm_scale: float, sliding_window: int | None = None,
    soft_cap: float | None = None, sinks: jax.Array | None = None,
) -> jax.Array:
    """Attention of q [T, H, D] over the paged KV of `layer`; see the oracle for the contract.
    `sinks` [H] (gpt-oss): per-head logits that join each softmax's denominator only; `meta.key_limit`
    [T] (bidirectional image spans): keys past each token's own position it also sees ([0] when None)."""
    sinks = jnp.zeros((0,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    key_limit = jnp.zeros((0,), jnp.int32) if meta.key_limit is None else meta.key_limit.astype(jnp.int32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q, k_cache, v_cache, jnp.asarray(layer, jnp.int32), meta.query_start_loc, meta.seq_lens,
                meta.block_tables, meta.num_seqs, sinks, key_limit, sm_scale=np.float32(sm_scale),
                sliding_window=np.int64(sliding_window or 0), soft_cap=np.float32(soft_cap or 0.0))
