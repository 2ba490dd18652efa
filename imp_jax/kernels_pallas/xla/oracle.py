"""The attention oracle: dense, slow and obviously correct. Every backend is tested against it."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from imp_jax.kernels_pallas.kv_cache import as_float32
from imp_jax.kernels_pallas.metadata import AttentionMetadata, key_reach, token_positions


def ragged_paged_attention_oracle(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, meta: AttentionMetadata,
    layer: jax.Array | int, *, sm_scale: float, sliding_window: int | None = None,
    soft_cap: float | None = None, sinks: jax.Array | None = None,
) -> jax.Array:
    """Each token of q [T, H, D] against every key its sequence's block table reaches.

    Causal (with `meta.key_limit`: keys up to max(pos, limit)); a sliding window keeps keys with
    pos - window < key_pos; soft-cap applies cap * tanh(s / cap) to the scores; padding tokens give
    zeros. K/V must already be written.
    `sinks` [H] (gpt-oss): a logit per head joining the softmax as one more column, its value dropped.
    """
    T, H, D = q.shape
    KVH = k_cache.shape[3]
    seq, pos, valid = token_positions(meta, T)
    blocks = meta.block_tables[seq]                                     # [T, max_blocks]
    k = as_float32(k_cache[layer][blocks]).reshape(T, -1, KVH, D)       # [T, N, KVH, D]
    v = as_float32(v_cache[layer][blocks]).reshape(T, -1, KVH, D)
    key_pos = jnp.arange(k.shape[1])
    visible = (key_pos[None, :] <= key_reach(meta, seq, pos)[:, None]) & valid[:, None]
    if sliding_window is not None:
        visible &= key_pos[None, :] > pos[:, None] - sliding_window
    qg = q.astype(jnp.float32).reshape(T, KVH, H // KVH, D)
    s = jnp.einsum("tkgd,tnkd->tkgn", qg, k) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
    s = jnp.where(valid[:, None, None, None], s, 0.0)
    if sinks is None:
        p = jax.nn.softmax(s, axis=-1)
    else:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, KVH, H // KVH, 1), s.shape[:3] + (1,))
        p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
    out = jnp.einsum("tkgn,tnkd->tkgd", p, v)
    return jnp.where(valid[:, None, None, None], out, 0.0).reshape(T, H, D).astype(q.dtype)
