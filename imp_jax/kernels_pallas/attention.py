"""The one attention entry point models call: write the step's new K/V, then attend over the pages
with the implementation the engine chose (`Kernels.attention`)."""
from __future__ import annotations

import jax

from imp_jax.kernels_pallas.backends import XLA, Kernels
from imp_jax.kernels_pallas.cpu.attention import ragged_paged_attention_cpu
from imp_jax.kernels_pallas.kv_cache import write_kv
from imp_jax.kernels_pallas.metadata import AttentionMetadata
from imp_jax.kernels_pallas.xla.attention import ragged_paged_attention_xla


def ragged_paged_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
    meta: AttentionMetadata, layer: jax.Array | int, *, sm_scale: float,
    sliding_window: int | None = None, soft_cap: float | None = None, kernels: Kernels = XLA,
    sinks: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Write k/v [T, KVH, D] at meta.slot_mapping into `layer` of the stacked caches, then attend.

    q: [T, H, D]; caches: [L, num_blocks, block_size, KVH, D]. Returns (out [T, H, D], k_cache, v_cache).
    """
    k_cache, v_cache = write_kv(k_cache, v_cache, k, v, meta.slot_mapping, layer)
    out = paged_attention(q, k_cache, v_cache, meta, layer, sm_scale=sm_scale, sliding_window=sliding_window,
                          soft_cap=soft_cap, kernels=kernels, sinks=sinks)
    return out, k_cache, v_cache


def paged_attention(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, meta: AttentionMetadata, layer: jax.Array | int, *,
    sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None, kernels: Kernels = XLA,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """The attention half of `ragged_paged_attention`, the step's K/V already in the caches: out [T, H, D].
    A model that picks a layer's window at run time (`lax.cond`, model/architectures/gemma.py) calls it in each branch,
    which then only read the caches. `sinks` [H] (gpt-oss): per-head logits in each softmax's
    denominator, never soft-capped (every backend takes them)."""
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    if kernels.attention == "pallas":
        # imported here: the Mosaic GPU modules take ~0.4 s to import, paid only where the kernel runs
        from imp_jax.kernels_pallas.pallas.ragged_paged_attention import ragged_paged_attention_pallas
        return ragged_paged_attention_pallas(q, k_cache, v_cache, meta, layer, **kw,
                                             interpret=kernels.pallas_interpret)
    if kernels.attention == "cpu":
        return ragged_paged_attention_cpu(q, k_cache, v_cache, meta, layer, **kw)
    return ragged_paged_attention_xla(q, k_cache, v_cache, meta, layer, **kw, dynamic_skips=kernels.dynamic_skips)
