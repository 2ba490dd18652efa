"""XLA reference ragged paged attention: short, obviously correct, and the oracle for every kernel.

It reads only the pages a sequence owns (never a dense context), its cost follows the longest
cached prefix in the batch, not the pool size or max_model_len, and a prefill's keys are read
once per step rather than once per query token.
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
    soft_cap: float | None = None,
) -> jax.Array:
    """Attention of q [T, H, D] over the paged KV of `layer` (caches [L, NB, BS, KVH, D]).

    Causal inside each sequence; a sliding window keeps keys with pos - window < key_pos;
    soft-cap applies cap * tanh(s / cap) to the scores. Padding tokens produce zeros.
    The step's own K/V must already be written (`write_kv`).

    Two parts merged by one online softmax, so that a prefill reads its keys once, not once per
    query token:
    1. this step's tokens against each other: one dense [T, T] product masked to same
       sequence and causal (the new K/V are read back from the cache at `slot_mapping`);
    2. each token against its sequence's KV cached before this step, walked through the
       block table a few blocks at a time. Rows [0, S) and [S, T) walk separately, each as
       far as its own sequences' cached prefixes go: the scheduler puts decodes first, so a
       long decode context does not make every prefill row walk it too.
    """
    T, H, D = q.shape
    _, NB, BS, KVH, _ = k_cache.shape
    S = meta.seq_lens.shape[0]
    seq, pos, valid = token_positions(meta, T)
    qg = q.astype(jnp.float32).reshape(T, KVH, H // KVH, D) * sm_scale
    slots = jnp.clip(meta.slot_mapping, 0, NB * BS - 1)
    k_new = k_cache[layer, slots // BS, slots % BS].astype(jnp.float32)     # [T, KVH, D]
    v_new = v_cache[layer, slots // BS, slots % BS].astype(jnp.float32)
    q_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    live = jnp.arange(S) < meta.num_seqs
    cached = jnp.where(live, meta.seq_lens - q_lens, 0)                    # per slot: KV before this step

    def attend(state, s, v, mask, pv):
        """Fold scores s [T', KVH, G, N] (masked by [T', N]) and values into (m, l, acc)."""
        m, l, acc = state
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        scale = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
        return m_new, l * scale + jnp.sum(p, axis=-1), acc * scale[..., None] + pv(p, v)

    def window(mask, q_pos, key_pos):
        return mask if sliding_window is None else mask & (key_pos > q_pos - sliding_window)

    # 1. the step's own tokens
    G = H // KVH
    init = (jnp.full((T, KVH, G), -jnp.inf, jnp.float32), jnp.zeros((T, KVH, G), jnp.float32),
            jnp.zeros((T, KVH, G, D), jnp.float32))
    mask = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None]) & valid[None, :]
    state = attend(init, jnp.einsum("tkgd,jkd->tkgj", qg, k_new), v_new,
                   window(mask, pos[:, None], pos[None, :]),
                   lambda p, v: jnp.einsum("tkgj,jkd->tkgd", p, v))

    # 2. the cached prefix of each token's sequence, rows [0, S) and [S, T) separately
    blocks_per_step = max(1, min(8, 2048 // (BS * T)))   # keeps the gathered K/V near 1-2 MB
    chunk = BS * blocks_per_step
    max_blocks = meta.block_tables.shape[1]
    tables = jnp.pad(meta.block_tables, ((0, 0), (0, (-max_blocks) % blocks_per_step)))

    def walk_prefix(state, rows: slice):
        qr, seq_r, pos_r = qg[rows], seq[rows], pos[rows]
        n = qr.shape[0]
        before = cached[seq_r]
        owners = (jnp.arange(S) >= seq_r[0]) & (jnp.arange(S) <= seq_r[-1])
        steps = (jnp.max(jnp.where(owners, cached, 0)) + chunk - 1) // chunk

        def body(i, st):
            cols = i * blocks_per_step + jnp.arange(blocks_per_step)
            blocks = tables[seq_r[:, None], cols[None, :]]                    # [n, C]
            k = k_cache[layer, blocks].reshape(n, chunk, KVH, D).astype(jnp.float32)
            v = v_cache[layer, blocks].reshape(n, chunk, KVH, D).astype(jnp.float32)
            key_pos = i * chunk + jnp.arange(chunk)
            mask = window(key_pos[None, :] < before[:, None], pos_r[:, None], key_pos[None, :])
            return attend(st, jnp.einsum("tkgd,tskd->tkgs", qr, k), v, mask,
                          lambda p, v: jnp.einsum("tkgs,tskd->tkgd", p, v))

        return jax.lax.fori_loop(0, steps, body, state)

    parts = [slice(0, min(S, T))] + ([slice(S, T)] if T > S else [])
    outs = []
    for rows in parts:
        outs.append(walk_prefix(tuple(x[rows] for x in state), rows))
    m, l, acc = (jnp.concatenate(xs) for xs in zip(*outs))
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(T, H, D).astype(q.dtype)
