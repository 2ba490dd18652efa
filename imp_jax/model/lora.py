"""LoRA slabs: every adapter's low-rank matrices in fixed-size device arrays, one set per projection.

A projection `name` fuses PEFT target modules (`qkv_proj` = q|k|v, `gate_up_proj` = gate|up), its
`parts`. Per layer it has one A slab [P * N * r, in] (part-major, then slot, then rank: the x @ A^T
of every part and slot is one GEMM) and one B slab per part [out_p, N * r], for N adapter slots of
rank r (max_lora_rank; smaller ranks are zero-padded; the alpha/r scale is folded into B at load).
Both are in the [out, in] layout of every other matrix, so the same GEMM (kernels_pallas/gemm.py)
runs them. Slot s (1..N) owns rows of A / columns of B [(s-1) r, s r); adapter index 0 is "no
adapter" and owns none, so a base row's delta is exactly zero. Each token row picks its slot
through a 0/1 mask on the rank axis, so a batch mixes adapters freely (no gather, no per-adapter
loop) and loading one only rewrites slab values, never a shape. The cost: every row multiplies
all N slots' ranks, N * r extra columns per projection.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from imp_jax.kernels_pallas import XLA, Kernels, matmul_wt



@dataclasses.dataclass(frozen=True)
class LoraOptions:
    """The slab sizes: adapter slots (besides "none") and the largest rank an adapter may have."""

    max_loras: int
    max_rank: int

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_rank < 1:
            raise ValueError(f"LoRA slabs need max_loras >= 1 and max_rank >= 1, got {self}")


@dataclasses.dataclass(frozen=True)
class LoraTarget:
    """Where a PEFT target module (q_proj, ...) lives: projection `fused`, part `part` of its outputs."""

    fused: str
    part: int
    in_dim: int
    out_dim: int


class LoraSlab(nnx.Param):
    """An adapter slab (zero in every slot nothing is loaded into); written only by the engine."""


@dataclasses.dataclass(frozen=True)
class LoraDelta:
    """One projection's slabs for one layer, with the step's per-row slot mask [T, N * r]."""

    a: jax.Array                 # [P * N * r, in]
    bs: tuple[jax.Array, ...]    # P x [out_p, N * r]
    mask: jax.Array              # float32 [T, N * r]: 1 where the rank column belongs to the row's slot

    def __call__(self, x: jax.Array, kernels: Kernels = XLA) -> jax.Array:
        """x A[slot]^T B[slot]^T per row, float32 [T, sum(out_p)]."""
        h = matmul_wt(x, self.a, kernels) * jnp.tile(self.mask, (1, len(self.bs)))
        h = h.astype(x.dtype)
        parts = jnp.split(h, len(self.bs), axis=-1)
        return jnp.concatenate([matmul_wt(p, b, kernels) for p, b in zip(parts, self.bs)], axis=-1)


class LoraSlabs(nnx.Module):
    """Per projection and layer: an A slab and a B slab per part (module docstring); all zeros at first."""

    def __init__(self, projections: dict[str, tuple[int, tuple[int, ...]]], num_layers: int,
                 options: LoraOptions, dtype: jnp.dtype):
        self.options = options
        self.projections = projections
        width = options.max_loras * options.max_rank
        for name, (in_dim, outs) in projections.items():
            setattr(self, name + "_a", nnx.List([
                LoraSlab(jnp.zeros((len(outs) * width, in_dim), dtype), axes=(None, None))
                for _ in range(num_layers)]))
            setattr(self, name + "_b", nnx.List([
                nnx.List([LoraSlab(jnp.zeros((out, width), dtype), axes=(None, None)) for out in outs])
                for _ in range(num_layers)]))

    def layer(self, name: str, i: int) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """Projection `name`'s slabs of layer i."""
        return getattr(self, name + "_a")[i][...], tuple(b[...] for b in getattr(self, name + "_b")[i])

    def all_layers(self, name: str) -> tuple[tuple[jax.Array, ...], tuple[tuple[jax.Array, ...], ...]]:
        """Every layer's (A, Bs) of `name`, for the layer loop's per-layer pick."""
        n = len(getattr(self, name + "_a"))
        a_s, b_s = zip(*(self.layer(name, i) for i in range(n)))
        return a_s, b_s

    def slab(self, name: str, layer: int, which: str, part: int = 0) -> LoraSlab:
        """The Variable holding one slab: which = "a" or "b" (then of part `part`)."""
        return getattr(self, name + "_a")[layer] if which == "a" else getattr(self, name + "_b")[layer][part]


def row_mask(lora_ids: jax.Array, options: LoraOptions) -> jax.Array:
    """float32 [T, N * r]: 1 in the r columns of each row's slot (lora_ids 1..N), none for 0."""
    col_slot = jnp.arange(options.max_loras * options.max_rank, dtype=jnp.int32) // options.max_rank + 1
    return (lora_ids[:, None] == col_slot[None, :]).astype(jnp.float32)
