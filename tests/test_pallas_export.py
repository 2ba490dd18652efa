"""The Pallas attention kernel exported for CUDA on a CPU (`jax.export`, platforms=("cuda",)) over every
shape `supports()` accepts, in the pinned Mosaic GPU lowering mode and in the other one.

Export runs the whole Pallas -> Mosaic GPU lowering (layouts, TMA, wgmma, and Mosaic's own refusal of
a kernel whose shared memory passes the 227 KiB a Hopper block may use); only the PTX compilation and
the run need a GPU. Shapes that build the same kernel program lower alike, so one representative per
distinct `kernel_config` is exported: the whole grid in both modes would take minutes.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from support.kernels import assert_hopper_kernel

from imp_jax.kernels_pallas import AttentionMetadata, AttentionShape
from imp_jax.kernels_pallas.pallas import ragged_paged_attention as rpa
from imp_jax.kernels_pallas.pallas import shapes
from imp_jax.kernels_pallas.pallas.shapes import SMEM_LIMIT, block_kv_for, rows_per_item, smem_bytes, supports

KV_HEADS = 8
GRID = [AttentionShape(jnp.dtype(dtype), jnp.dtype(dtype), group * KV_HEADS, KV_HEADS, head_dim, block_size, sinks)
        for head_dim, group, block_size, dtype, sinks in itertools.product(
            (64, 128, 192, 256), (1, 2, 4, 8), (8, 16, 32, 64, 128, 256), (jnp.bfloat16, jnp.float16),
            (False, True))]
ACCEPTED = [s for s in GRID if supports(s)]
OTHER = next(mode for mode in plgpu.LoweringSemantics if mode != rpa.LOWERING)


class KernelConfig(NamedTuple):
    """The static facts the kernel program is built from (`ragged_paged_attention_pallas`)."""

    block_kv: int
    rows: int                  # MMA rows of a work item
    head_dim: int
    dtype: str                 # the cache's; q is cast to it
    pages: int                 # pages per kv step: one TMA each


def kernel_config(shape: AttentionShape) -> KernelConfig:
    """Shapes of equal configs lower alike. Left out: the group (beyond `rows`, only a constant divisor of
    the row index), the sinks (the kernel always reads sink rows, -1e30 without sinks), kv heads (a grid axis)."""
    bk = block_kv_for(shape.block_size)
    return KernelConfig(bk, rows_per_item(shape.num_heads // shape.num_kv_heads), shape.head_dim,
                        jnp.dtype(shape.cache_dtype).name, bk // shape.block_size)


def representatives(key: Callable[[AttentionShape], tuple]) -> dict[tuple, AttentionShape]:
    """One accepted shape per distinct key: the one with the most pages per kv step (the most TMAs)."""
    reps: dict[tuple, AttentionShape] = {}
    for shape in sorted(ACCEPTED, key=lambda s: s.block_size):
        reps.setdefault(key(shape), shape)
    return reps


# every config in the pinned mode; the other mode, a canary for a jax upgrade, per config but the pages
REPRESENTATIVES = representatives(kernel_config)
OTHER_REPRESENTATIVES = representatives(lambda s: kernel_config(s)[:4])
REFUSED = {kernel_config(s): s for s in GRID if not supports(s)}


def export(shape: AttentionShape, lowering: plgpu.LoweringSemantics, kv_splits: int = 1) -> str:
    """The kernel on `shape` (a 16-token batch over 4 sequences, abstract arrays) exported for CUDA: its text."""
    t, s, pages = 16, 4, 8
    i32 = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.int32)   # noqa: E731
    q = jax.ShapeDtypeStruct((t, shape.num_heads, shape.head_dim), shape.q_dtype)
    cache = jax.ShapeDtypeStruct((1, s * pages + 1, shape.block_size, shape.num_kv_heads, shape.head_dim),
                                 shape.cache_dtype)
    meta = AttentionMetadata(i32(s + 1), i32(s), i32(s, pages), i32(t), i32())
    sinks = jax.ShapeDtypeStruct((shape.num_heads,), jnp.float32) if shape.sinks else None
    fn = functools.partial(rpa.ragged_paged_attention_pallas, sm_scale=0.1, kv_splits=kv_splits, lowering=lowering)
    exported = jax.export.export(jax.jit(fn), platforms=("cuda",))(q, cache, cache, meta, i32(), sinks=sinks)
    return exported.mlir_module()


def test_every_accepted_shape_has_a_representative() -> None:
    """The dedup is sound for `supports()`: it accepts all or none of a config's shapes (so nothing it
    accepts hides behind a refused representative), and every accepted shape's config is exported."""
    for config, alike in itertools.groupby(sorted(GRID, key=kernel_config), key=kernel_config):
        assert len({supports(s) for s in alike}) == 1, config
    assert {kernel_config(s) for s in ACCEPTED} == set(REPRESENTATIVES)
    assert (len(GRID), len(ACCEPTED), len(REPRESENTATIVES), len(OTHER_REPRESENTATIVES)) == (384, 304, 38, 14)


@pytest.mark.parametrize("config", list(REPRESENTATIVES), ids=lambda c: "-".join(map(str, c)))
def test_every_accepted_shape_lowers_for_cuda(config: KernelConfig) -> None:
    """Each representative exports for CUDA in the pinned mode, Mosaic's shared-memory check passed."""
    assert_hopper_kernel(export(REPRESENTATIVES[config], rpa.LOWERING), config.dtype)


@pytest.mark.parametrize("config", list(OTHER_REPRESENTATIVES), ids=lambda c: "-".join(map(str, c)))
def test_the_other_lowering_mode_lowers_every_config_too(config: tuple) -> None:
    """What the other mode does today (jax 0.10.2): it lowers the kernel too (Warpgroup runs its layout
    inference and dialect lowering here as well); a jax where it no longer does fails here."""
    assert_hopper_kernel(export(OTHER_REPRESENTATIVES[config], OTHER), config[3])


@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
def test_split_kv_lowers_for_cuda(head_dim: int) -> None:
    """Split-KV adds an f32 partial-output scope, shaped by the rows (64 for every accepted group) and
    the head dim only; its shared memory is never the larger scope's (`smem_bytes`)."""
    shape = dataclasses.replace(REPRESENTATIVES[KernelConfig(64, 64, head_dim, "bfloat16", 4)], sinks=True)
    assert_hopper_kernel(export(shape, rpa.LOWERING, kv_splits=2), "bfloat16")


def test_the_lowering_mode_reaches_mosaic() -> None:
    """`lowering=` is what Mosaic GPU lowers under: the two modes give different programs."""
    shape = next(iter(REPRESENTATIVES.values()))
    assert export(shape, rpa.LOWERING) != export(shape, OTHER)


@pytest.mark.parametrize("config", list(REFUSED), ids=lambda c: "-".join(map(str, c)))
def test_refused_shapes_overflow_shared_memory(config: KernelConfig, monkeypatch) -> None:
    """The budget is real: each config of the grid `supports()` refuses is refused for its shared memory
    alone, and lowered past that budget, Mosaic GPU itself refuses the kernel, whose real size lies
    between SMEM_LIMIT and the `smem_bytes` estimate (an upper bound). Mosaic checks before it lowers
    the kernel body, so this costs little."""
    shape = REFUSED[config]
    monkeypatch.setattr(shapes, "SMEM_LIMIT", float("inf"))
    assert supports(shape), "refused for something besides its shared memory"
    with pytest.raises(ValueError, match="exceeds available shared memory") as err:
        export(shape, rpa.LOWERING)
    used = int(re.search(r"smem_bytes=(\d+)", str(err.value)).group(1))
    assert SMEM_LIMIT < used <= smem_bytes(shape)
