"""Device <-> host copies of whole KV blocks, as compiled programs of fixed shapes.

`gather` reads N block ids out of the stacked caches into one array [N, *BLOCK_PAYLOAD]; `scatter`
writes such an array back at N block ids into the donated caches (in place). N is padded up to a
bucket of COPY_BUCKETS and longer lists run in chunks of the largest, so every program is compiled
when the copier is built and serving compiles nothing. Both only dispatch (JAX runs them
asynchronously, in launch order with the steps, which read and write the same cache): a gather
starts its device -> host transfer at once and the host reads it whenever it next looks.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from imp_jax.runtime.sharding import kv_sharding, replicated

COPY_BUCKETS = (1, 4, 16, 64)   # blocks per program run; ~4x apart: 8 small programs in all

KV = tuple[jax.Array, jax.Array]


def _gather(kv: KV, ids: jax.Array) -> jax.Array:
    k, v = kv
    return jnp.moveaxis(jnp.stack([k[:, ids], v[:, ids]]), 2, 0)   # [2, L, N, ...] -> [N, 2, L, ...]


def _scatter(kv: KV, ids: jax.Array, blocks: jax.Array) -> KV:
    k, v = kv
    blocks = jnp.moveaxis(blocks, 0, 2)   # [N, 2, L, ...] -> [2, L, N, ...]; ids out of range are dropped
    return k.at[:, ids].set(blocks[0], mode="drop"), v.at[:, ids].set(blocks[1], mode="drop")


class BlockCopier:
    """The gather and scatter programs of one KV cache shape, every bucket compiled up front."""

    def __init__(self, kv_spec: tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct], mesh: Mesh):
        kv_sh, rep = kv_sharding(mesh), replicated(mesh)
        L, NB, BS, KVH, D = kv_spec[0].shape
        self.num_blocks = NB
        self.dtype = kv_spec[0].dtype
        self.payload_shape = (2, L, BS, KVH, D)
        self.block_bytes = int(np.prod(self.payload_shape)) * self.dtype.itemsize
        self._rep = rep
        ids = lambda n: jax.ShapeDtypeStruct((n,), jnp.int32, sharding=rep)
        blocks = lambda n: jax.ShapeDtypeStruct((n, *self.payload_shape), self.dtype, sharding=rep)
        gather = jax.jit(_gather, in_shardings=((kv_sh, kv_sh), rep), out_shardings=rep)
        scatter = jax.jit(_scatter, donate_argnums=(0,), in_shardings=((kv_sh, kv_sh), rep, rep),
                          out_shardings=(kv_sh, kv_sh))
        self._gather = {n: gather.lower(kv_spec, ids(n)).compile() for n in COPY_BUCKETS}
        self._scatter = {n: scatter.lower(kv_spec, ids(n), blocks(n)).compile() for n in COPY_BUCKETS}

    def gather(self, kv: KV, block_ids: list[int]) -> list[tuple[jax.Array, int]]:
        """Dispatch reads of `block_ids`: per chunk, (device array [bucket, *payload], blocks used), its host
        transfer started. Read them with `to_host`."""
        out = []
        for start, n, bucket in _chunks(len(block_ids)):
            ids = np.zeros(bucket, np.int32)   # padding reads the null block
            ids[:n] = block_ids[start:start + n]
            arr = self._gather[bucket](kv, jax.device_put(ids, self._rep))
            arr.copy_to_host_async()
            out.append((arr, n))
        return out

    def scatter(self, kv: KV, block_ids: list[int], payload: np.ndarray) -> KV:
        """Dispatch writes of `payload` [len(block_ids), *payload] at `block_ids`; returns the new caches."""
        for start, n, bucket in _chunks(len(block_ids)):
            ids = np.full(bucket, self.num_blocks, np.int32)   # padding writes nowhere
            ids[:n] = block_ids[start:start + n]
            blocks = np.zeros((bucket, *self.payload_shape), self.dtype)
            blocks[:n] = payload[start:start + n]
            kv = self._scatter[bucket](kv, jax.device_put(ids, self._rep), jax.device_put(blocks, self._rep))
        return kv


def to_host(chunks: list[tuple[jax.Array, int]]) -> np.ndarray:
    """A gather's blocks on the host, [n, *payload], owning its memory (waits for the copy if need be)."""
    return np.concatenate([np.asarray(arr)[:n] for arr, n in chunks])


def _chunks(n: int) -> list[tuple[int, int, int]]:
    """(start, count, bucket) runs covering n blocks: the largest bucket while it is filled, then the smallest
    that holds the rest."""
    out, start, top = [], 0, COPY_BUCKETS[-1]
    while n - start > top:
        out.append((start, top, top))
        start += top
    if n > start:
        out.append((start, n - start, next(b for b in COPY_BUCKETS if b >= n - start)))
    return out
