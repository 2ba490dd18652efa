"""Ragged paged attention for x86-64 CPUs (cpu_attention.cc), called as an XLA FFI custom call.

Same contract and results (to float32 rounding) as `reference.ragged_paged_attention_reference`,
but each query token reads its keys and values once, straight from the paged cache, instead of
the gathered copies the reference's einsums need: several times faster on decode steps. It takes
float32 queries over float32 or bfloat16 caches (`--kv-cache-dtype`) with a head_dim that is a
multiple of 8; the program lowers to the reference on any
other platform it is compiled for (`platform_dependent`). Built on first use (cpu_kernels.py);
IMP_JAX_ATTENTION=reference turns it off.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from imp_jax.kernels_pallas import cpu_kernels
from imp_jax.kernels_pallas.metadata import AttentionMetadata
from imp_jax.kernels_pallas.reference import BF16_BITS, ragged_paged_attention_reference

TARGET = "imp_ragged_paged_attention_f32"


def available() -> bool:
    """Whether the kernel is built, loaded and registered for this CPU (built on the first call)."""
    return cpu_kernels.register("cpu_attention", TARGET, "ImpRaggedPagedAttentionF32")


def supports(q: jax.Array, k_cache: jax.Array) -> bool:
    """Whether the kernel takes these operands: float32 queries over float32 or bfloat16 caches
    (or bfloat16 bits in uint16, `reference.kv_storage_dtype`), head_dim a multiple of 8."""
    return (q.dtype == jnp.float32 and k_cache.dtype in (jnp.float32, jnp.bfloat16, BF16_BITS)
            and q.shape[-1] % 8 == 0)


def ragged_paged_attention_cpu(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, meta: AttentionMetadata,
    layer: jax.Array | int, *, sm_scale: float, sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Attention of q [T, H, D] over the paged KV of `layer`; see the reference for the contract."""
    def kernel(q, k_cache, v_cache, meta, layer):
        call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
        return call(q, k_cache, v_cache, layer, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                    meta.num_seqs, sm_scale=np.float32(sm_scale),
                    sliding_window=np.int64(sliding_window or 0), soft_cap=np.float32(soft_cap or 0.0))

    def reference(q, k_cache, v_cache, meta, layer):
        return ragged_paged_attention_reference(q, k_cache, v_cache, meta, layer, sm_scale=sm_scale,
                                                sliding_window=sliding_window, soft_cap=soft_cap)

    layer = jnp.asarray(layer, jnp.int32)
    return jax.lax.platform_dependent(q, k_cache, v_cache, meta, layer, cpu=kernel, default=reference)
