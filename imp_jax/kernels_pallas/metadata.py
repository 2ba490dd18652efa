"""AttentionMetadata: how a flat ragged token batch maps onto sequences and KV-cache pages;
AttentionShape: the static facts a backend needs to say whether it takes a model."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Device arrays describing one step's ragged batch of T tokens over S sequence slots.

    Sequence s owns query tokens `query_start_loc[s]:query_start_loc[s+1]` (cu_q_lens), has
    `seq_lens[s]` tokens of KV after this step, and reads its KV through `block_tables[s]`.
    Padding sequences have zero query tokens and seq_len 0; padding tokens sit past
    `query_start_loc[num_seqs]` and have `slot_mapping == -1` (their K/V is written nowhere).
    `key_limit` (bidirectional image spans, Gemma 3): token t at KV position p attends keys
    k <= max(p, key_limit[t]) (never past its sequence's seq_len); -1 is plain causal. A sliding
    window still drops keys with p - k >= window. None (every step without such spans) is causal.
    """

    query_start_loc: jax.Array  # int32 [S + 1]
    seq_lens: jax.Array         # int32 [S]
    block_tables: jax.Array     # int32 [S, max_blocks_per_seq]; unused entries point at block 0
    slot_mapping: jax.Array     # int32 [T]; block_id * block_size + offset, or -1
    num_seqs: jax.Array         # int32 []
    key_limit: jax.Array | None = None   # int32 [T]; -1: causal (the class docstring)


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """The dtypes and head layout every attention call of a model has (checked once, at engine build)."""

    q_dtype: Any
    cache_dtype: Any            # the array dtype holding the cache (kv_cache.kv_storage_dtype)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    sinks: bool = False         # per-head attention-sink logits (gpt-oss): every kernel takes them today
    key_limits: bool = False    # per-token key limits (bidirectional image spans, Gemma 3): every kernel takes them

    @classmethod
    def of(cls, q: jax.Array, k_cache: jax.Array) -> "AttentionShape":
        """The shape of q [T, H, D] over caches [L, NB, BS, KVH, D]."""
        _, _, bs, kvh, d = k_cache.shape
        return cls(jnp.dtype(q.dtype), jnp.dtype(k_cache.dtype), q.shape[1], kvh, d, bs)


def token_positions(meta: AttentionMetadata, num_tokens: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per token of the flat batch: its sequence slot, its position in that sequence's KV, and
    whether it is real (not padding)."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    qsl = meta.query_start_loc
    num_slots = meta.seq_lens.shape[0]
    # compare_all: tokens x slots comparisons in one fused op (a few thousand), where the default scan is
    # a loop of small dependent ops on the step's critical path on a GPU
    seq = jnp.searchsorted(qsl[1:], t, side="right", method="compare_all")
    seq = jnp.clip(seq, 0, num_slots - 1).astype(jnp.int32)
    valid = t < qsl[meta.num_seqs]
    pos = meta.seq_lens[seq] - (qsl[seq + 1] - t)
    return seq, pos, valid


def key_reach(meta: AttentionMetadata, seq: jax.Array, pos: jax.Array) -> jax.Array:
    """Per token (of `token_positions`' seq and pos): the last KV position it attends, max(pos, key_limit)
    kept inside its sequence's KV; pos itself without key limits."""
    if meta.key_limit is None:
        return pos
    return jnp.maximum(pos, jnp.minimum(meta.key_limit, meta.seq_lens[seq] - 1))
