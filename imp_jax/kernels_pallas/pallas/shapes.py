"""What the Pallas attention kernel takes, decided without importing Pallas (engine start-up on a
host without a GPU never loads the Mosaic GPU modules)."""
from __future__ import annotations

import math

import jax.numpy as jnp

from imp_jax.kernels_pallas.metadata import AttentionShape
from imp_jax.kernels_pallas.pallas.split_kv import LSE_COLS

MMA_ROWS = 64            # wgmma M per warpgroup on Hopper
# Hopper's shared memory a block may opt into (H100, H200: 227 KiB), less what Mosaic GPU and the
# alignment of each buffer may take beside the kernel's own buffers (an estimate, kept generous)
SMEM_LIMIT = 227 * 1024
SMEM_RESERVE = 8 * 1024
SMEM_ALIGN = 1024        # each buffer starts on a 1 KiB boundary (128-byte swizzled tiles)


def block_kv_for(block_size: int, block_kv: int = 64) -> int:
    """Keys per loop step: a multiple of the page size and of the 64-key wgmma K tile."""
    return block_kv if block_kv % block_size == 0 else block_size * math.ceil(block_kv / block_size)


def rows_per_item(group: int) -> int:
    """The MMA rows of one work item: its query tokens times the group's heads, in 64-row tiles."""
    block_q = max(1, MMA_ROWS // group)
    return MMA_ROWS * math.ceil(block_q * group / MMA_ROWS)


def smem_bytes(shape: AttentionShape, block_kv: int = 64) -> int:
    """The shared memory one program of the kernel holds at once (ragged_paged_attention.py): q, two
    stages of K and of V, the probabilities, the sinks and the rows' last keys (key limits: counted
    whether a call has them or not) in its main scope, then (split-KV) the f32 partial output and its
    lse; each buffer aligned, barriers and Mosaic's own scratch in the reserve."""
    bk = block_kv_for(shape.block_size, block_kv)
    rows, d = rows_per_item(shape.num_heads // shape.num_kv_heads), shape.head_dim
    item = jnp.dtype(shape.cache_dtype).itemsize
    align = lambda n: SMEM_ALIGN * math.ceil(n / SMEM_ALIGN)   # noqa: E731
    main = (align(rows * d * item) + 2 * align(2 * bk * d * item) + align(rows * bk * item) + 2 * align(rows * 4))
    partial = align(rows * d * 4) + align(rows * LSE_COLS * 4)
    return max(main, partial) + SMEM_RESERVE


def supports(shape: AttentionShape) -> bool:
    """Whether the compiled (GPU) kernel takes a model of this shape: 16-bit queries and caches,
    TMA/wgmma-friendly tiles, and buffers that fit in a block's shared memory (`smem_bytes`).
    Attention sinks (gpt-oss) are no constraint: the kernel takes them."""
    bk = block_kv_for(shape.block_size)
    group = shape.num_heads // shape.num_kv_heads
    sixteen = (jnp.bfloat16, jnp.float16)
    return (shape.cache_dtype in sixteen and shape.q_dtype in sixteen
            and shape.head_dim % 64 == 0 and shape.head_dim <= 256
            and shape.block_size % 8 == 0 and bk % 64 == 0 and bk <= 256 and group <= 2 * MMA_ROWS
            and smem_bytes(shape) <= SMEM_LIMIT)
