"""Ragged paged attention: one entry point, dispatching to Pallas on supported GPUs, XLA elsewhere."""
from imp_jax.kernels_pallas.attention import ragged_paged_attention
from imp_jax.kernels_pallas.metadata import AttentionMetadata
from imp_jax.kernels_pallas.reference import kv_storage_dtype

__all__ = ["AttentionMetadata", "kv_storage_dtype", "ragged_paged_attention"]
