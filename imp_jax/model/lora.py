"""LoRA slabs: every adapter's low-rank matrices in fixed-size device arrays, one set per projection.

A projection `name` fuses PEFT target modules (`qkv_proj` = q|k|v, `gate_up_proj` = gate|up), its
`parts`. Per layer it has one A slab [in, P * N * r] (part-major, then slot, then rank: the x @ A of
every part and slot is one GEMM) and one B slab per part [N * r, out_p], for N adapter slots of rank
r (max_lora_rank; smaller ranks are zero-padded; the alpha/r scale is folded into B at load). Slot
s (1..N) owns columns / rows [(s-1) r, s r); adapter index 0 is "no adapter" and owns none, so a
base row's delta is exactly zero. Each token row picks its slot through a 0/1 column mask, so
a batch mixes adapters freely and loading one only rewrites slab values (never a shape).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx



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

    a: jax.Array                 # [in, P * N * r]
    bs: tuple[jax.Array, ...]    # P x [N * r, out_p]
    mask: jax.Array              # float32 [T, N * r]: 1 where the column belongs to the row's slot

    def __call__(self, x: jax.Array) -> jax.Array:
        """x @ A[slot] @ B[slot] per row, float32 [T, sum(out_p)]."""
        dot = lambda u, v: jax.lax.dot_general(u, v.astype(u.dtype), (((u.ndim - 1,), (0,)), ((), ())),
                                               preferred_element_type=jnp.float32)
        h = dot(x, self.a) * jnp.tile(self.mask, (1, len(self.bs)))
        parts = jnp.split(h, len(self.bs), axis=-1)
        return jnp.concatenate([dot(p, b) for p, b in zip(parts, self.bs)], axis=-1)


class LoraSlabs(nnx.Module):
    """Per projection and layer: an A slab and a B slab per part (module docstring); all zeros at first."""

    def __init__(self, projections: dict[str, tuple[int, tuple[int, ...]]], num_layers: int,
                 options: LoraOptions, dtype: jnp.dtype):
        self.options = options
        self.projections = projections
        width = options.max_loras * options.max_rank
        for name, (in_dim, outs) in projections.items():
            setattr(self, name + "_a", nnx.List([
                LoraSlab(jnp.zeros((in_dim, len(outs) * width), dtype), axes=(None, None))
                for _ in range(num_layers)]))
            setattr(self, name + "_b", nnx.List([
                nnx.List([LoraSlab(jnp.zeros((width, out), dtype), axes=(None, None)) for out in outs])
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
