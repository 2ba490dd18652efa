"""The paged KV cache's storage: the array dtype that holds it, reading it, writing a step's new K/V.

Every attention backend shares this layout: per layer K and V of [num_blocks, block_size,
num_kv_heads, head_dim], stacked over layers; block 0 is the null block padding points at.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

# A bfloat16 KV cache on a CPU is stored as its bits in uint16: XLA's CPU compiler widens a
# bfloat16 scatter to float32, converting the whole cache there and back on every layer, and a
# bitcast of the whole cache is a copy too (docs/PERF.md, "bfloat16 K/V").
BF16_BITS = jnp.uint16


def kv_storage_dtype(dtype, platform: str) -> jnp.dtype:
    """The array dtype that holds a KV cache of `dtype` on `platform` ("cpu", "gpu", ...)."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(BF16_BITS) if dtype == jnp.bfloat16 and platform == "cpu" else dtype


def as_float32(x: jax.Array) -> jax.Array:
    """Cache values (float32, bfloat16, or bfloat16 bits in uint16) as float32."""
    if x.dtype == BF16_BITS:
        x = jax.lax.bitcast_convert_type(x, jnp.bfloat16)
    return x.astype(jnp.float32)


def write_kv(k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array, layer: jax.Array | int) -> tuple[jax.Array, jax.Array]:
    """Write new K/V [T, KVH, D] of `layer` at `slot_mapping` in stacked caches [L, NB, BS, KVH, D].

    Slots < 0 (padding) are dropped. Under jit with donated caches XLA updates in place.
    """
    L, NB, BS, KVH, D = k_cache.shape
    slots = jnp.where(slot_mapping < 0, NB * BS, slot_mapping)  # out of range -> dropped
    blk, off = slots // BS, slots % BS

    def put(cache: jax.Array, new: jax.Array) -> jax.Array:
        if cache.dtype == BF16_BITS:
            new = jax.lax.bitcast_convert_type(new.astype(jnp.bfloat16), BF16_BITS)
        return cache.at[layer, blk, off].set(new.astype(cache.dtype), mode="drop")

    return put(k_cache, k), put(v_cache, v)
