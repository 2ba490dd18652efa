"""Tensor parallelism and LoRA inside the projections, so a model's layers read as their math.

A forward pass builds one `Projections` over its per-layer matrices and calls each projection by
name, declaring it column- or row-parallel as Megatron does:

    proj = Projections(self.tp, kernels, matrices, self.lora, lora_ids)
    qkv = proj.column("qkv_proj", h, i, bias=w.get("qkv_bias"))   # this shard's output columns
    x = x + proj.row("o_proj", attn, i)                            # the shards' partial sums, summed

On one device both are `layers.linear` plus the adapters' delta. On N shards the weights are
stored shard-major (model/tensor_parallel.py): a column-parallel matrix holds this shard's output
rows, so its output is this shard's slice (no collective); a row-parallel one holds this shard's
input columns, so its outputs are partial sums that `reduce` adds over the shards (a psum), with
the bias added on shard 0 only (`once`). The embedding (a vocab-parallel lookup) and the LM head
(this shard's slice of the vocabulary, which the mesh gathers) carry their adapters' deltas too.
LoRA adapters and tensor parallelism do not run together yet (runtime/core/builder.py refuses).
"""
from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from imp_jax.kernels_pallas import XLA, Kernels
from imp_jax.model.layers import embed, linear
from imp_jax.model.lora import LoraDelta, LoraLayers, LoraSlabs
from imp_jax.model.tensor_parallel import AXIS, TensorParallel


class Projections:
    """One forward pass's projections (module docstring): every layer's [out, in] matrices by name,
    the shards they are split over, the GEMM kernels, and the step's adapters (`lora` slabs with
    each row's slot `lora_ids`; either None: no adapters)."""

    def __init__(self, tp: TensorParallel, kernels: Kernels = XLA,
                 matrices: Mapping[str, tuple[jax.Array, ...]] | None = None,
                 lora: LoraSlabs | None = None, lora_ids: jax.Array | None = None):
        self.tp, self.kernels, self.matrices = tp, kernels, matrices or {}
        self.lora: LoraSlabs | None = None
        self.lora_ids: jax.Array | None = None
        self.loras: dict[str, LoraLayers] = {}
        if lora is not None and lora_ids is not None:   # adapters enabled, and the step's rows name theirs
            self.lora, self.lora_ids = lora, lora_ids
            self.loras = {name: lora.all_layers(name, lora_ids) for name in lora.layered}

    def column(self, name: str, x: jax.Array, i: jax.Array | int, bias: jax.Array | None = None) -> jax.Array:
        """Layer i's projection `name` of x, column-parallel: this shard's output columns (its slice
        of `bias` with them), plus the adapters' delta."""
        return _layer_linear(x, self.matrices[name], i, bias, self.kernels, self.loras.get(name))

    def row(self, name: str, x: jax.Array, i: jax.Array | int, bias: jax.Array | None = None) -> jax.Array:
        """Layer i's projection `name` of x, row-parallel: x is this shard's slice of the input, the
        shards' partial outputs are summed and `bias` (whole on every shard) is added once."""
        bias = None if bias is None else self.once(bias)
        return self.reduce(_layer_linear(x, self.matrices[name], i, bias, self.kernels, self.loras.get(name)))

    def reduce(self, partial: jax.Array) -> jax.Array:
        """The sum over shards of a row-parallel block's partial outputs (itself on one device): a
        block that adds several partials (a mixture of experts' experts and shared expert) sums
        them first and reduces once."""
        return partial if self.tp.n == 1 else jax.lax.psum(partial, AXIS)

    def once(self, bias: jax.Array) -> jax.Array:
        """A row-parallel block's bias as this shard adds it: whole on shard 0, zeros elsewhere, so
        `reduce` adds it exactly once (itself on one device)."""
        return bias if self.tp.n == 1 else jnp.where(jax.lax.axis_index(AXIS) == 0, bias, jnp.zeros_like(bias))

    def embed(self, table: jax.Array, ids: jax.Array, dtype: jnp.dtype, scale: float | None = None) -> jax.Array:
        """The tokens' embeddings as `dtype` (times `scale` in that dtype, when given), plus the
        embedding adapters' delta. A vocab-parallel shard looks the ids up in its slice of the table
        and the shards sum (exactly: one of them holds each row, the others add zeros)."""
        x = self._lookup(table, ids, dtype)
        if scale is not None:
            x = x * jnp.asarray(scale, dtype)
        delta = self._global("embed_tokens")
        if delta is not None:
            x = (x + delta.embed(ids, self.kernels.dynamic_skips)).astype(x.dtype)
        return x

    def head(self, table: jax.Array, h: jax.Array) -> jax.Array:
        """The LM head on h, float32 [R, vocab] (on a vocab-parallel shard its slice, which the mesh
        gathers), plus the head adapters' delta."""
        return linear(h, table, kernels=self.kernels, out_dtype=jnp.float32, lora=self._global("lm_head"))

    def _lookup(self, table: jax.Array, ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
        if not self.tp.vocab_parallel:
            return embed(table, ids, dtype)
        local = ids - jax.lax.axis_index(AXIS) * table.shape[0]
        mine = (local >= 0) & (local < table.shape[0])
        rows = embed(table, jnp.where(mine, local, 0), dtype)
        return jax.lax.psum(jnp.where(mine[:, None], rows, 0), AXIS)

    def _global(self, name: str) -> LoraDelta | None:
        """A model-wide module's adapters' delta (`lm_head`, `embed_tokens`); None without one."""
        if self.lora is None or self.lora_ids is None:
            return None
        return self.lora.global_delta(name, self.lora_ids)


def _layer_linear(x: jax.Array, ws: tuple[jax.Array, ...], i: jax.Array | int, b: jax.Array | None,
                  kernels: Kernels, lora: LoraLayers | None = None) -> jax.Array:
    """`linear(x, ws[i], b)` (plus layer i's LoRA delta) for a static or traced layer index, never
    copying ws[i] or its slabs."""
    def one(x, ws, b, lora, j):
        delta = None if lora is None else lora.layer(j)
        return linear(x, ws[j], b, kernels=kernels, lora=delta)
    if isinstance(i, int):
        return one(x, ws, b, lora, i)
    branches = [lambda x, ws, b, lora, j=j: one(x, ws, b, lora, j) for j in range(len(ws))]
    return jax.lax.switch(i, branches, x, ws, b, lora)
