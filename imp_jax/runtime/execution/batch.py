"""Host-side batch building: ragged chunks of sequences -> padded numpy arrays for one step."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of a step: `token_ids` at positions start..start+len-1, KV via `block_table`."""

    token_ids: Sequence[int]
    start: int                     # tokens already in the KV cache before this chunk
    block_table: Sequence[int]
    lora_slot: int = 0             # its LoRA adapter's slot (runtime/scheduling/lora.py); 0 = none


@dataclasses.dataclass
class StepBatch:
    """Padded host arrays for one model call; field names follow AttentionMetadata."""

    input_ids: np.ndarray        # int32 [T]
    positions: np.ndarray        # int32 [T]
    query_start_loc: np.ndarray  # int32 [S + 1]
    seq_lens: np.ndarray         # int32 [S]
    block_tables: np.ndarray | None   # int32 [S, max_blocks]; None: the rows are on the device (table_rows)
    slot_mapping: np.ndarray     # int32 [T]
    num_seqs: np.ndarray         # int32 []
    last_token_rows: np.ndarray  # int32 [S]: row of each sequence's last token (0 for padding)
    lora_ids: np.ndarray         # int32 [T]: each token's LoRA slot, 0 = none (and for padding)
    # device-resident tables (runtime/scheduling/block_tables.py): each row's slot, and the step's edits [3, U]
    table_rows: np.ndarray | None = None
    table_edits: np.ndarray | None = None


def bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= n."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def pow2_buckets(lo: int, hi: int) -> list[int]:
    """Powers of two from lo up to hi, with hi itself last if it is not one."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return out + [hi]


def build_step_batch(chunks: Sequence[SeqChunk], *, num_tokens: int, num_seqs: int,
                     max_blocks: int, block_size: int, with_tables: bool = True) -> StepBatch:
    """Lay `chunks` out as a flat ragged batch padded to `num_tokens` tokens and `num_seqs` slots.
    `with_tables=False` leaves `block_tables` None (the engine's step reads device-resident rows):
    each chunk's `block_table` is then read only where its tokens' KV goes."""
    T, S = num_tokens, num_seqs
    input_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    slot_mapping = np.full(T, -1, np.int32)
    qsl = np.zeros(S + 1, np.int32)
    seq_lens = np.zeros(S, np.int32)
    tables = np.zeros((S, max_blocks), np.int32) if with_tables else None
    last_rows = np.zeros(S, np.int32)
    lora_ids = np.zeros(T, np.int32)
    t = 0
    for s, c in enumerate(chunks):
        n = len(c.token_ids)
        if n == 1:   # a decode row: scalars (numpy's per-call cost dominates one token)
            input_ids[t] = c.token_ids[0]
            positions[t] = c.start
            slot_mapping[t] = c.block_table[c.start // block_size] * block_size + c.start % block_size
        else:
            pos = np.arange(c.start, c.start + n, dtype=np.int32)
            first = c.start // block_size
            table = np.asarray(c.block_table[first:(c.start + n - 1) // block_size + 1], np.int32)
            input_ids[t:t + n] = c.token_ids
            positions[t:t + n] = pos
            slot_mapping[t:t + n] = table[pos // block_size - first] * block_size + pos % block_size
        if tables is not None:
            tables[s, :len(c.block_table)] = c.block_table
        if c.lora_slot:
            lora_ids[t:t + n] = c.lora_slot
        seq_lens[s] = c.start + n
        t += n
        qsl[s + 1] = t
        last_rows[s] = t - 1
    qsl[len(chunks) + 1:] = t
    return StepBatch(input_ids, positions, qsl, seq_lens, tables, slot_mapping,
                     np.asarray(len(chunks), np.int32), last_rows, lora_ids)
