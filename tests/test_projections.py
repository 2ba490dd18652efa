"""Projections (model/projections.py): on one device each projection is `layers.linear` plus its adapters'
delta; on two shards (fake CPU devices, in a child process: the device count is fixed when jax starts) a
row-parallel projection summed over the shards is the whole projection, and a column-parallel one is its slice.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 PYTHONPATH=. python tests/test_projections.py
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from imp_jax.model.layers import embed, linear
from imp_jax.model.lora import LoraOptions, LoraSlabs
from imp_jax.model.projections import Projections
from imp_jax.model.tensor_parallel import TensorParallel

ROOT = Path(__file__).resolve().parents[1]
T, E, O, V, L = 5, 16, 12, 40, 3   # tokens, input width, output width, vocabulary, layers


def shards(n: int, vocab_parallel: bool = False) -> TensorParallel:
    """A layout of n shards (only `n` and `vocab_parallel` matter to Projections)."""
    return TensorParallel(n, True, 1, 1, 1, vocab_parallel)


def random_lora(rng: np.random.Generator) -> LoraSlabs:
    """Slabs of two adapter slots for projection "p" (two parts), the LM head and the embedding, all non-zero."""
    slabs = LoraSlabs({"p": (E, (O // 2, O // 2)), "lm_head": (E, (V,)), "embed_tokens": (V, (E,))}, L,
                      LoraOptions(max_loras=2, max_rank=4), jnp.float32)
    for name in slabs.projections:
        for layer in range(1 if name in slabs.GLOBAL else L):
            for which in "ab":
                slab = slabs.slab(name, layer, which)
                slab.set_value(jnp.asarray(rng.normal(0, 0.5, slab.shape), jnp.float32))
        if name in slabs.GLOBAL:
            getattr(slabs, name + "_on").set_value(jnp.ones((3,), jnp.int32))
    return slabs


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(0)
    ws = tuple(jnp.asarray(rng.normal(0, 0.3, (O, E)), jnp.float32) for _ in range(L))
    return dict(x=jnp.asarray(rng.normal(size=(T, E)), jnp.float32), ws=ws, lora=random_lora(rng),
                bias=jnp.asarray(rng.normal(size=(O,)), jnp.float32), ids=jnp.asarray([0, 1, 2, 1, 0], jnp.int32),
                table=jnp.asarray(rng.normal(size=(V, E)), jnp.float32))


@pytest.mark.parametrize("with_lora", [False, True])
def test_column_and_row_on_one_device_are_linear_plus_the_layers_delta(case, with_lora):
    """Layer i's projection, static or traced i, is `linear(x, ws[i], bias)` with layer i's delta, bit for bit;
    the delta is really there (rows of slot 0 have none, the others differ)."""
    lora = case["lora"] if with_lora else None
    proj = Projections(shards(1), matrices={"p": case["ws"]}, lora=lora, lora_ids=case["ids"])
    x, bias = case["x"], case["bias"]
    for i in range(L):
        delta = case["lora"].all_layers("p", case["ids"]).layer(i) if with_lora else None
        want = linear(x, case["ws"][i], bias, lora=delta)
        traced = jax.jit(lambda x, i: (proj.column("p", x, i, bias=bias), proj.row("p", x, i, bias=bias)))
        for got in (proj.column("p", x, i, bias=bias), proj.row("p", x, i, bias=bias), *traced(x, jnp.int32(i))):
            np.testing.assert_array_equal(got, want)
    plain = linear(x, case["ws"][0], bias)
    rows_with_adapters = np.asarray(case["ids"]) > 0
    changed = np.any(np.asarray(proj.column("p", x, 0, bias=bias)) != np.asarray(plain), axis=1)
    assert list(changed) == (list(rows_with_adapters) if with_lora else [False] * T)


def test_embedding_and_head_carry_their_adapters_delta(case):
    """The embedding (scaled, then its delta, as PEFT orders them) and the LM head with theirs."""
    lora, ids, table, x = case["lora"], case["ids"], case["table"], case["x"]
    proj = Projections(shards(1), lora=lora, lora_ids=ids)
    rows = embed(table, ids, jnp.float32) * jnp.asarray(2.0, jnp.float32)
    want = (rows + lora.global_delta("embed_tokens", ids).embed(ids)).astype(jnp.float32)
    np.testing.assert_array_equal(proj.embed(table, ids, jnp.float32, scale=2.0), want)
    np.testing.assert_array_equal(proj.head(table, x),
                                  linear(x, table, out_dtype=jnp.float32, lora=lora.global_delta("lm_head", ids)))
    bare = Projections(shards(1))
    np.testing.assert_array_equal(bare.embed(table, ids, jnp.float32), embed(table, ids, jnp.float32))
    assert not np.array_equal(proj.embed(table, ids, jnp.float32), bare.embed(table, ids, jnp.float32))


def test_two_shards_sum_to_the_whole_projection():
    """The child below, on two fake CPU devices."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"


def two_shards() -> None:
    """Row-parallel: each shard holds half of x's columns and of w's input columns, and the bias whole: the
    psum of the halves is linear(x, w, bias) (to float32 rounding: the sum splits in two). Column-parallel:
    each shard's output is its half of the output columns, exactly. A vocab-parallel lookup is exact."""
    from jax.sharding import Mesh, PartitionSpec as P

    from imp_jax.model.tensor_parallel import AXIS

    assert jax.device_count() == 2, jax.devices()
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(T, E)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(O, E)), jnp.float32)
    bias = jnp.asarray(rng.normal(size=(O,)), jnp.float32)
    table = jnp.asarray(rng.normal(size=(V, E)), jnp.float32)
    ids = jnp.asarray([0, 39, 20, 19, 7], jnp.int32)
    mesh = Mesh(np.array(jax.devices()), (AXIS,))

    def per_shard(x_cols, w_cols, w_rows, bias_rows, table_rows):
        proj = Projections(shards(2, vocab_parallel=True), matrices={"row": (w_cols,), "col": (w_rows,)})
        return (proj.row("row", x_cols, 0, bias=bias), proj.column("col", x, 0, bias=bias_rows),
                proj.embed(table_rows, ids, jnp.float32))

    row, col, rows = jax.jit(jax.shard_map(
        per_shard, mesh=mesh, check_vma=False, in_specs=(P(None, AXIS), P(None, AXIS), P(AXIS), P(AXIS), P(AXIS)),
        out_specs=(P(), P(None, AXIS), P())))(x, w, w, bias, table)
    np.testing.assert_allclose(row, linear(x, w, bias), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(col, linear(x, w, bias))
    np.testing.assert_array_equal(rows, embed(table, ids, jnp.float32))
    print("ok")


if __name__ == "__main__":
    two_shards()
