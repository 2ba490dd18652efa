"""LoRA slabs: every adapter's low-rank matrices in fixed-size device arrays, one pair per projection.

A projection `name` fuses PEFT target modules (`qkv_proj` = q|k|v, `gate_up_proj` = gate|up), its
`parts`. Per layer it has one A slab [N, P * r, in] (slot, then part, then rank: the [out, in]
layout of every other matrix) and one B slab [N, r, sum(out_p)] (slot, then rank; B transposed, the
parts side by side), for N adapter slots of rank r (max_lora_rank; smaller ranks are zero-padded;
the alpha/r scale is folded into B at load; float16 on a CPU: `slab_dtype`). Slot s (1..N) is
index s - 1; adapter index 0 is "no adapter" and owns none, so a base row's delta is exactly zero.
Each token row carries its slot (`lora_ids`), so a batch mixes adapters freely and loading one only
rewrites slab values, never a shape. Two formulations, one result (to float32 rounding):
- the CPU kernel (kernels_pallas/cpu/lora.py): each row multiplies its own slot's matrices only;
- XLA's (any backend): every row multiplies all N slots' ranks, masked to its own, N * r columns
  per part; a step where no row has an adapter skips it (`lax.cond`, with `dynamic_skips`). Masks
  are selects (`jnp.where`), never products with 0, so a non-finite slot stays in its own rows.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from imp_jax.kernels_pallas import XLA, Kernels, matmul_wt
from imp_jax.kernels_pallas.cpu import lora as cpu_lora


@dataclasses.dataclass(frozen=True)
class LoraOptions:
    """The slab sizes: adapter slots (besides "none") and the largest rank an adapter may have."""

    max_loras: int
    max_rank: int

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_rank < 1:
            raise ValueError(f"LoRA slabs need max_loras >= 1 and max_rank >= 1, got {self}")


def slab_dtype(kernels: Kernels, dtype: jnp.dtype) -> jnp.dtype:
    """The slabs' element type: float16 where the CPU kernel reads them for a float32 model (a decode
    step streams every used slot's slabs, so half the bytes is most of their cost; float16 holds
    bfloat16 and float16 adapters exactly and rounds float32 ones to 11 bits), else the model's."""
    return jnp.dtype(jnp.float16) if kernels.cpu_gemm and dtype == jnp.float32 else jnp.dtype(dtype)


@dataclasses.dataclass(frozen=True)
class LoraTarget:
    """Where a PEFT target module (q_proj, ...) lives: projection `fused`, part `part` of its outputs."""

    fused: str
    part: int
    in_dim: int
    out_dim: int


class LoraSlab(nnx.Param):
    """An adapter slab (zero in every slot nothing is loaded into); written only by the engine."""


def _own_slot(h: jax.Array, ids: jax.Array) -> jax.Array:
    """h [T, N, ...] (every slot's values for every row) with all but row t's slot ids[t] selected to 0.
    A select, not a product with a 0/1 mask: 0 * NaN is NaN, and one tenant's adapter must not reach
    another's rows."""
    mine = ids[:, None] == jnp.arange(1, h.shape[1] + 1, dtype=ids.dtype)[None, :]
    return jnp.where(mine.reshape(mine.shape + (1,) * (h.ndim - 2)), h, jnp.zeros((), h.dtype))


def _finite(bt: jax.Array) -> jax.Array:
    """The B slab with non-finite entries selected to 0: the contraction over slots multiplies every
    slot's B by each row's (selected) zeros, and 0 * inf is NaN. Load refuses such adapters
    (model/formats/peft.py); this keeps one that got into a slot anyway inside its own rows."""
    return jnp.where(jnp.isfinite(bt), bt, jnp.zeros((), bt.dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraDelta:
    """One projection's slabs for one layer, with the step's per-row slots [T] (0 = none)."""

    a: jax.Array                 # [N, P * r, in]
    bt: jax.Array                # [N, r, sum(out_p)]
    ids: jax.Array               # int32 [T]
    parts: tuple[int, ...] = dataclasses.field(metadata={"static": True})   # out_p of each part

    def __call__(self, x: jax.Array, kernels: Kernels = XLA) -> jax.Array:
        """x A[slot]^T B[slot]^T per row, float32 [T, sum(out_p)]."""
        if kernels.cpu_gemm and cpu_lora.takes(x, self.a, self.bt):
            compute = lambda: cpu_lora.lora_delta_cpu(x, self.ids, self.a, self.bt, self.parts)
        else:
            compute = lambda: self._masked(x, kernels)
        if not kernels.dynamic_skips:
            return compute()
        return jax.lax.cond(jnp.any(self.ids > 0), compute,
                            lambda: jnp.zeros((x.shape[0], sum(self.parts)), jnp.float32))

    def _masked(self, x: jax.Array, kernels: Kernels) -> jax.Array:
        """Every slot's delta for every row, masked to the row's own slot."""
        N, PR, K = self.a.shape
        r, P = self.bt.shape[1], len(self.parts)
        h = matmul_wt(x, self.a.reshape(N * PR, K), kernels).reshape(-1, N, P, r)
        h = _own_slot(h, self.ids).astype(x.dtype)
        bt = _finite(self.bt)
        bounds = np.cumsum((0,) + self.parts)
        return jnp.concatenate([
            jnp.einsum("tnr,nro->to", h[:, :, p], bt[:, :, bounds[p]:bounds[p + 1]],
                       preferred_element_type=jnp.float32) for p in range(P)], axis=-1)


    def embed(self, token_ids: jax.Array, dynamic_skips: bool = True) -> jax.Array:
        """PEFT's Embedding LoRA, float32 [T, dim]: row t's B[slot] A[slot][:, token t] (A [N, r, vocab]
        read by token id, not multiplied)."""
        def compute() -> jax.Array:
            h = jnp.transpose(self.a[:, :, token_ids], (2, 0, 1)).astype(jnp.float32)   # [T, N, r]
            return jnp.einsum("tnr,nro->to", _own_slot(h, self.ids), _finite(self.bt),
                              preferred_element_type=jnp.float32)
        if not dynamic_skips:
            return compute()
        return jax.lax.cond(jnp.any(self.ids > 0), compute,
                            lambda: jnp.zeros((token_ids.shape[0], sum(self.parts)), jnp.float32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraLayers:
    """One projection's slabs of every layer and the step's slots, for the layer loop's per-layer pick."""

    a_s: tuple[jax.Array, ...]
    bt_s: tuple[jax.Array, ...]
    ids: jax.Array
    parts: tuple[int, ...] = dataclasses.field(metadata={"static": True})

    def layer(self, i: int) -> LoraDelta:
        return LoraDelta(self.a_s[i], self.bt_s[i], self.ids, self.parts)


class LoraSlabs(nnx.Module):
    """Per projection and layer: an A slab and a B slab (module docstring); all zeros at first.

    The model-wide modules (`lm_head`, `embed_tokens`: one "layer") also have a per-slot flag [N + 1]
    (`<name>_on`, 1 where the slot's adapter has the module), so rows of adapters without it skip it:
    the LM head's B slab is N * r * vocab, too large to multiply for nothing. `embed_tokens` is PEFT's
    Embedding LoRA: its A [r, vocab] is read by token id (a gather), not multiplied.
    """

    GLOBAL = ("lm_head", "embed_tokens")

    def __init__(self, projections: dict[str, tuple[int, tuple[int, ...]]], num_layers: int,
                 options: LoraOptions, dtype: jnp.dtype):
        self.options = options
        self.projections = projections
        N, r = options.max_loras, options.max_rank
        for name, (in_dim, outs) in projections.items():
            layers = 1 if name in self.GLOBAL else num_layers
            setattr(self, name + "_a", nnx.List([
                LoraSlab(jnp.zeros((N, len(outs) * r, in_dim), dtype), axes=(None, None, None))
                for _ in range(layers)]))
            setattr(self, name + "_b", nnx.List([
                LoraSlab(jnp.zeros((N, r, sum(outs)), dtype), axes=(None, None, None)) for _ in range(layers)]))
            if name in self.GLOBAL:
                setattr(self, name + "_on", LoraSlab(jnp.zeros((N + 1,), jnp.int32), axes=(None,)))

    @property
    def layered(self) -> list[str]:
        """The per-layer projections (every one but the model-wide modules)."""
        return [name for name in self.projections if name not in self.GLOBAL]

    def global_delta(self, name: str, ids: jax.Array) -> LoraDelta | None:
        """Model-wide module `name`'s delta for rows of slots `ids`, rows of adapters without it as slot 0;
        None when the model has no such module."""
        if name not in self.projections:
            return None
        ids = ids * getattr(self, name + "_on")[...][ids]
        return LoraDelta(getattr(self, name + "_a")[0][...], getattr(self, name + "_b")[0][...], ids,
                         self.projections[name][1])

    def all_layers(self, name: str, ids: jax.Array) -> LoraLayers:
        """Every layer's slabs of projection `name`, with the step's slots."""
        a_s, b_s = getattr(self, name + "_a"), getattr(self, name + "_b")
        return LoraLayers(tuple(a[...] for a in a_s), tuple(b[...] for b in b_s), ids, self.projections[name][1])

    def slab(self, name: str, layer: int, which: str) -> LoraSlab:
        """The Variable holding one slab: which = "a" or "b"."""
        return getattr(self, f"{name}_{which}")[layer]
