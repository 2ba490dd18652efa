"""XLA reference ragged paged attention: short, obviously correct, and the oracle for every kernel.

It walks each token's sequence block by block with an online softmax, so it reads only the
pages a sequence owns (never a dense context) and its cost follows the longest sequence in
the batch, not the pool size or max_model_len.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from imp_jax.kernels_pallas.metadata import AttentionMetadata


def write_kv(k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array, layer: jax.Array | int) -> tuple[jax.Array, jax.Array]:
    """Write new K/V [T, KVH, D] of `layer` at `slot_mapping` in stacked caches [L, NB, BS, KVH, D].

    Slots < 0 (padding) are dropped. Under jit with donated caches XLA updates in place.
    """
    L, NB, BS, KVH, D = k_cache.shape
    slots = jnp.where(slot_mapping < 0, NB * BS, slot_mapping)  # out of range -> dropped
    blk, off = slots // BS, slots % BS
    k_cache = k_cache.at[layer, blk, off].set(k.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[layer, blk, off].set(v.astype(v_cache.dtype), mode="drop")
    return k_cache, v_cache


def token_positions(meta: AttentionMetadata, num_tokens: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per token: its sequence index, its position in that sequence's KV, and whether it is real."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    qsl = meta.query_start_loc
    num_slots = meta.seq_lens.shape[0]
    seq = jnp.clip(jnp.searchsorted(qsl[1:], t, side="right"), 0, num_slots - 1).astype(jnp.int32)
    valid = t < qsl[meta.num_seqs]
    pos = meta.seq_lens[seq] - (qsl[seq + 1] - t)
    return seq, pos, valid


def ragged_paged_attention_reference(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, meta: AttentionMetadata,
    layer: jax.Array | int, *, sm_scale: float, sliding_window: int | None = None,
    soft_cap: float | None = None, blocks_per_step: int = 4,
) -> jax.Array:
    """Attention of q [T, H, D] over the paged KV of `layer` (caches [L, NB, BS, KVH, D]).

    Causal inside each sequence; a sliding window keeps keys with pos - window < key_pos;
    soft-cap applies cap * tanh(s / cap) to the scores. Padding tokens produce zeros.
    """
    T, H, D = q.shape
    _, _, BS, KVH, _ = k_cache.shape
    G = H // KVH
    seq, pos, valid = token_positions(meta, T)
    max_blocks = meta.block_tables.shape[1]
    seq_lens = jnp.where(jnp.arange(meta.seq_lens.shape[0]) < meta.num_seqs, meta.seq_lens, 0)
    steps = (jnp.max(seq_lens) + BS * blocks_per_step - 1) // (BS * blocks_per_step)
    chunk = BS * blocks_per_step
    qg = q.astype(jnp.float32).reshape(T, KVH, G, D) * sm_scale
    tables = jnp.pad(meta.block_tables, ((0, 0), (0, (-max_blocks) % blocks_per_step)))

    def body(i, carry):
        m, l, acc = carry
        cols = i * blocks_per_step + jnp.arange(blocks_per_step)
        blocks = tables[seq[:, None], cols[None, :]]                     # [T, C]
        k = k_cache[layer, blocks].reshape(T, chunk, KVH, D).astype(jnp.float32)
        v = v_cache[layer, blocks].reshape(T, chunk, KVH, D).astype(jnp.float32)
        s = jnp.einsum("tkgd,tskd->tkgs", qg, k)                         # [T, KVH, G, chunk]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        key_pos = i * chunk + jnp.arange(chunk)
        mask = key_pos[None, :] <= pos[:, None]
        if sliding_window is not None:
            mask &= key_pos[None, :] > pos[:, None] - sliding_window
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        scale = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
        l = l * scale + jnp.sum(p, axis=-1)
        acc = acc * scale[..., None] + jnp.einsum("tkgs,tskd->tkgd", p, v)
        return m_new, l, acc

    init = (jnp.full((T, KVH, G), -jnp.inf, jnp.float32), jnp.zeros((T, KVH, G), jnp.float32),
            jnp.zeros((T, KVH, G, D), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, steps, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(T, H, D).astype(q.dtype)
