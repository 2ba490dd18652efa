"""Ragged paged attention: one entry point, dispatching to Pallas on supported GPUs, XLA elsewhere."""
from imp_jax.kernels_pallas.attention import ragged_paged_attention
from imp_jax.kernels_pallas.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "ragged_paged_attention"]
