"""Ragged paged attention in plain XLA: the portable backend (any platform, any dtype).

It reads only the pages a sequence owns (never a dense context), its cost follows the longest
cached prefix in the batch, not the pool size or max_model_len, and a prefill's keys are read
once per step rather than once per query token. Tests check it against `oracle.py`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from imp_jax.kernels_pallas.kv_cache import as_float32
from imp_jax.kernels_pallas.metadata import AttentionMetadata, key_reach, token_positions


TILE_ROWS = 64   # query rows per tile


def ragged_paged_attention_xla(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, meta: AttentionMetadata,
    layer: jax.Array | int, *, sm_scale: float, sliding_window: int | None = None,
    soft_cap: float | None = None, dynamic_skips: bool = True, sinks: jax.Array | None = None,
) -> jax.Array:
    """Attention of q [T, H, D] over the paged KV of `layer` (caches [L, NB, BS, KVH, D]).

    Causal inside each sequence (with `meta.key_limit`, token t also sees its sequence's keys up to
    key_limit[t]: they are all this step's own tokens, as the scheduler never ends a chunk inside such
    a span, so only part 1 below looks at them); a sliding window keeps keys with pos - window < key_pos;
    soft-cap applies cap * tanh(s / cap) to the scores; `sinks` [H] (gpt-oss) are per-head logits
    that join each softmax's denominator only (folded in after the online softmax). Padding
    tokens produce zeros.
    The step's own K/V must already be written (`write_kv`).

    Query rows go in tiles of TILE_ROWS; each tile merges two parts with one online softmax,
    so that a prefill reads its keys once per tile, not once per query token:
    1. the step's own tokens, masked to same sequence and causal, from the key tile holding
       the first row of the tile's first sequence up to the tile itself (the new K/V are read
       back from the cache at `slot_mapping`);
    2. each row's sequence's KV cached before this step, walked through the block table as far
       as the tile's longest cached prefix. A tile whose rows all belong to one sequence (a
       prefill chunk) gathers each key block once for all its rows; a tile of several (decodes)
       gathers per row. Tiles of fresh prompts walk nothing.

    With `dynamic_skips` off (GPUs: see `Kernels`) both parts loop to static bounds, the whole
    block table and every earlier tile (every tile, with key limits), masked, and tiles always
    gather per row: more work, but no data-dependent branch or trip count for the host to wait on. The engine's step then hands
    it only its context bucket's leading columns of the tables (runtime/execution/step.py), so the walk
    follows the step's longest sequence, rounded up to a power of two, not max_model_len.
    """
    T, H, D = q.shape
    _, NB, BS, KVH, _ = k_cache.shape
    S = meta.seq_lens.shape[0]
    seq, pos, valid = token_positions(meta, T)
    reach = key_reach(meta, seq, pos)
    qg = q.astype(jnp.float32).reshape(T, KVH, H // KVH, D) * sm_scale
    slots = jnp.clip(meta.slot_mapping, 0, NB * BS - 1)
    k_new = as_float32(k_cache[layer, slots // BS, slots % BS])     # [T, KVH, D]
    v_new = as_float32(v_cache[layer, slots // BS, slots % BS])
    q_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    live = jnp.arange(S) < meta.num_seqs
    cached = jnp.where(live, meta.seq_lens - q_lens, 0)                    # per slot: KV before this step

    def attend(state, s, v, mask, pv):
        """Fold scores s [T', KVH, G, N] (masked by [T', N]) and values into (m, l, acc). A masked pair
        has p = 0, and 0 * NaN is NaN: non-finite values are selected to 0 first, so a row whose K/V
        went non-finite (an adapter's, say) reaches no other sequence's rows of the tile."""
        m, l, acc = state
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        scale = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
        v = jnp.where(jnp.isfinite(v), v, 0.0)
        return m_new, l * scale + jnp.sum(p, axis=-1), acc * scale[..., None] + pv(p, v)

    def window(mask, q_pos, key_pos):
        return mask if sliding_window is None else mask & (key_pos > q_pos - sliding_window)

    G = H // KVH
    tile = min(T, TILE_ROWS)
    n_tiles = -(-T // tile)
    pad = n_tiles * tile - T
    padded = lambda x: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    q_t, k_t, v_t, seq_t, pos_t, reach_t, valid_t = map(padded, (qg, k_new, v_new, seq, pos, reach, valid))
    max_blocks = meta.block_tables.shape[1]
    one_owner_blocks = 8                                      # blocks per step when a tile is one sequence
    per_row_blocks = max(1, min(8, 2048 // (BS * tile)))   # else: keeps the gathered K/V near 1-2 MB
    tables = {b: jnp.pad(meta.block_tables, ((0, 0), (0, (-max_blocks) % b)))   # whole steps of b blocks
              for b in (one_owner_blocks, per_row_blocks)}

    def own_tokens(i: int, st):
        """Part 1 for query tile i: key tiles from its first sequence's first row up to itself (with key
        limits: up to its rows' furthest key)."""
        q_i, seq_i, pos_i, reach_i = (x[i * tile:(i + 1) * tile] for x in (q_t, seq_t, pos_t, reach_t))

        def key_tile(j, st):
            k_j, v_j, seq_j, pos_j, ok_j = (jax.lax.dynamic_slice_in_dim(x, j * tile, tile)
                                            for x in (k_t, v_t, seq_t, pos_t, valid_t))
            mask = (seq_i[:, None] == seq_j[None, :]) & (pos_j[None, :] <= reach_i[:, None]) & ok_j[None, :]
            return attend(st, jnp.einsum("tkgd,jkd->tkgj", q_i, k_j), v_j,
                          window(mask, pos_i[:, None], pos_j[None, :]),
                          lambda p, v: jnp.einsum("tkgj,jkd->tkgd", p, v))

        if n_tiles == 1:
            return key_tile(0, st)
        if not dynamic_skips:
            return jax.lax.fori_loop(0, i + 1 if meta.key_limit is None else n_tiles, key_tile, st)
        first = jnp.where(valid_t[i * tile], meta.query_start_loc[seq_i[0]] // tile, i + 1)
        return jax.lax.fori_loop(first, i + 1 if meta.key_limit is None else last_key_tile(i), key_tile, st)

    def last_key_tile(i: int) -> jax.Array:
        """With key limits: one past the key tile holding tile i's furthest key (a row's key at KV
        position k is flat token t + k - pos_t: a sequence's step tokens are contiguous)."""
        rows = slice(i * tile, (i + 1) * tile)
        furthest = jnp.arange(i * tile, (i + 1) * tile) + reach_t[rows] - pos_t[rows]
        return jnp.clip(jnp.max(jnp.where(valid_t[rows], furthest, 0)) // tile + 1, i + 1, n_tiles)

    def cached_prefix(i: int, st):
        """Part 2 for query tile i: each row's sequence's KV from before this step, a few blocks at a time."""
        rows = slice(i * tile, (i + 1) * tile)
        q_i, seq_i, pos_i, ok_i = q_t[rows], seq_t[rows], pos_t[rows], valid_t[rows]
        before = jnp.where(ok_i, cached[seq_i], 0)

        def walk(blocks_per_step: int, one_owner: bool):
            chunk = BS * blocks_per_step
            table = tables[blocks_per_step]

            def body(c, st):
                cols = c * blocks_per_step + jnp.arange(blocks_per_step)
                key_pos = c * chunk + jnp.arange(chunk)
                mask = window(key_pos[None, :] < before[:, None], pos_i[:, None], key_pos[None, :])
                if one_owner:   # every row reads the same keys: gather them once, one GEMM
                    blocks = table[seq_i[0], cols]
                    k = as_float32(k_cache[layer, blocks].reshape(chunk, KVH, D))
                    v = as_float32(v_cache[layer, blocks].reshape(chunk, KVH, D))
                    return attend(st, jnp.einsum("tkgd,skd->tkgs", q_i, k), v, mask,
                                  lambda p, v: jnp.einsum("tkgs,skd->tkgd", p, v))
                blocks = table[seq_i[:, None], cols[None, :]]                     # [tile, C]
                k = as_float32(k_cache[layer, blocks].reshape(tile, chunk, KVH, D))
                v = as_float32(v_cache[layer, blocks].reshape(tile, chunk, KVH, D))
                return attend(st, jnp.einsum("tkgd,tskd->tkgs", q_i, k), v, mask,
                              lambda p, v: jnp.einsum("tkgs,tskd->tkgd", p, v))

            steps = table.shape[1] // blocks_per_step            # static: the whole table
            if dynamic_skips:
                steps = (jnp.max(before) + chunk - 1) // chunk    # only as far as the tile's longest prefix
            return lambda st: jax.lax.fori_loop(0, steps, body, st)

        if not dynamic_skips:
            return walk(per_row_blocks, False)(st)
        one_owner = jnp.all(~ok_i | (seq_i == seq_i[0]))
        return jax.lax.cond(one_owner, walk(one_owner_blocks, True), walk(per_row_blocks, False), st)

    outs = []
    for i in range(n_tiles):
        init = (jnp.full((tile, KVH, G), -jnp.inf, jnp.float32), jnp.zeros((tile, KVH, G), jnp.float32),
                jnp.zeros((tile, KVH, G, D), jnp.float32))
        outs.append(cached_prefix(i, own_tokens(i, init)))
    m, l, acc = (jnp.concatenate(xs)[:T] for xs in zip(*outs))
    if sinks is not None:   # one more column, of value sink, that adds to l and nothing to acc
        sink = sinks.astype(jnp.float32).reshape(1, KVH, G)
        m_new = jnp.maximum(m, sink)
        scale = jnp.exp(jnp.where(jnp.isfinite(m), m - m_new, -jnp.inf))
        l, acc = l * scale + jnp.exp(sink - m_new), acc * scale[..., None]
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(T, H, D).astype(q.dtype)
