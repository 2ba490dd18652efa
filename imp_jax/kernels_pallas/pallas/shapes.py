"""What the Pallas attention kernel takes, decided without importing Pallas (engine start-up on a
host without a GPU never loads the Mosaic GPU modules)."""
from __future__ import annotations

import math

import jax.numpy as jnp

from imp_jax.kernels_pallas.metadata import AttentionShape

MMA_ROWS = 64            # wgmma M per warpgroup on Hopper


def block_kv_for(block_size: int, block_kv: int = 64) -> int:
    """Keys per loop step: a multiple of the page size and of the 64-key wgmma K tile."""
    return block_kv if block_kv % block_size == 0 else block_size * math.ceil(block_kv / block_size)


def supports(shape: AttentionShape) -> bool:
    """Whether the compiled (GPU) kernel takes a model of this shape: 16-bit queries and caches and
    TMA/wgmma-friendly tiles. Attention sinks (gpt-oss) are no constraint: the kernel takes them."""
    bk = block_kv_for(shape.block_size)
    group = shape.num_heads // shape.num_kv_heads
    sixteen = (jnp.bfloat16, jnp.float16)
    return (shape.cache_dtype in sixteen and shape.q_dtype in sixteen
            and shape.head_dim % 64 == 0 and shape.head_dim <= 256
            and shape.block_size % 8 == 0 and bk % 64 == 0 and bk <= 256 and group <= 2 * MMA_ROWS)
