"""AttentionMetadata: how a flat ragged token batch maps onto sequences and KV-cache pages."""
from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Device arrays describing one step's ragged batch of T tokens over S sequence slots.

    Sequence s owns query tokens `query_start_loc[s]:query_start_loc[s+1]` (cu_q_lens), has
    `seq_lens[s]` tokens of KV after this step, and reads its KV through `block_tables[s]`.
    Padding sequences have zero query tokens and seq_len 0; padding tokens sit past
    `query_start_loc[num_seqs]` and have `slot_mapping == -1` (their K/V is written nowhere).
    """

    query_start_loc: jax.Array  # int32 [S + 1]
    seq_lens: jax.Array         # int32 [S]
    block_tables: jax.Array     # int32 [S, max_blocks_per_seq]; unused entries point at block 0
    slot_mapping: jax.Array     # int32 [T]; block_id * block_size + offset, or -1
    num_seqs: jax.Array         # int32 []
