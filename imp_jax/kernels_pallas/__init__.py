"""Kernels: ragged paged attention and the projection GEMM, each behind one dispatch point.

    attention.py, gemm.py   the entry points models call, dispatching on `Kernels`
    backends.py             `Kernels` and `select_kernels`: the choice, made once per engine
    metadata.py, kv_cache.py  the contracts: batch metadata, the paged cache's layout and writes
    ggml_blocks.py          GGUF block-quantised matrices (Q8_0, Q4_x, Q5_x, Q2_K-Q6_K)
    xla/                    plain XLA: the portable backend, and the attention oracle for tests
    pallas/                 the Mosaic GPU (Hopper) attention kernel
    cpu/                    the x86-64 C++ kernels (XLA FFI) and their build
"""
from imp_jax.kernels_pallas import ggml_blocks
from imp_jax.kernels_pallas.attention import paged_attention, ragged_paged_attention
from imp_jax.kernels_pallas.backends import XLA, Kernels, select_kernels
from imp_jax.kernels_pallas.gemm import matmul_wt
from imp_jax.kernels_pallas.kv_cache import kv_storage_dtype
from imp_jax.kernels_pallas.metadata import AttentionMetadata, AttentionShape

__all__ = ["XLA", "AttentionMetadata", "AttentionShape", "Kernels", "ggml_blocks", "kv_storage_dtype", "matmul_wt",
           "paged_attention", "ragged_paged_attention", "select_kernels"]
