"""Device <-> host copies of whole KV blocks, as compiled programs of fixed shapes.

`gather` reads N block ids out of the stacked caches into N block payloads [*BLOCK_PAYLOAD]; `scatter` writes N
payloads back at N block ids into the donated caches (in place). N is padded up to a bucket of COPY_BUCKETS and
longer lists run in chunks of the largest, so every program is compiled when the copier is built and serving
compiles nothing. Both only dispatch (JAX runs them asynchronously, in launch order with the steps, which read and
write the same cache).

Where the backend offers a `pinned_host` memory (`host_memory_kind`: GPUs; JAX's CPU backend has one too), the host
tier's payloads live there as JAX arrays: the gather program writes its outputs straight into pinned host memory
(the device -> host DMA is part of the program) and the scatter program reads pinned inputs (host -> device DMA,
no staging through pageable memory). Elsewhere a payload is a numpy array: a gather's outputs are device arrays
whose transfer starts at once (`copy_to_host_async`), read when landed; a scatter's inputs are `device_put`.
"""
from __future__ import annotations

from typing import Any, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from imp_jax.runtime.parallel.sharding import kv_sharding, replicated

COPY_BUCKETS = (1, 4, 16, 64)   # blocks per program run; ~4x apart: 8 small programs in all
PINNED = "pinned_host"

KV = tuple[jax.Array, jax.Array]
Payload = Union[np.ndarray, jax.Array]   # one block [*BLOCK_PAYLOAD]: numpy, or a JAX array in pinned host memory


def host_memory_kind(mesh: Mesh) -> str | None:
    """The memory the host tier keeps its blocks in: "pinned_host" when every device of `mesh` offers it (a JAX
    memory kind), None (pageable numpy arrays) otherwise."""
    for device in mesh.devices.flat:
        try:
            kinds = {m.kind for m in device.addressable_memories()}
        except Exception:   # a backend without memory kinds (jax raises its own error types for it)
            return None
        if PINNED not in kinds:
            return None
    return PINNED


def _gather(kv: KV, ids: jax.Array) -> tuple[jax.Array, ...]:
    k, v = kv
    return tuple(jnp.stack([k[:, ids[i]], v[:, ids[i]]]) for i in range(ids.shape[0]))   # each [2, L, ...]


def _scatter(device: NamedSharding, kv: KV, ids: jax.Array, *blocks: jax.Array) -> KV:
    k, v = kv
    stacked = jnp.stack([jax.device_put(b, device) for b in blocks], axis=2)   # [2, L, N, ...], on the device
    return k.at[:, ids].set(stacked[0], mode="drop"), v.at[:, ids].set(stacked[1], mode="drop")   # ids past: dropped


class BlockCopier:
    """The gather and scatter programs of one KV cache shape, every bucket compiled up front; payloads in
    `host_kind` memory ("pinned_host", or None: numpy)."""

    def __init__(self, kv_spec: tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct], mesh: Mesh,
                 host_kind: str | None = None):
        kv_sh, rep = kv_sharding(mesh), replicated(mesh)
        L, NB, BS, KVH, D = kv_spec[0].shape
        self.num_blocks = NB
        self.dtype = np.dtype(kv_spec[0].dtype)
        self.payload_shape = (2, L, BS, KVH, D)
        self.block_bytes = int(np.prod(self.payload_shape)) * self.dtype.itemsize
        self.host_kind = host_kind
        self._rep = rep
        self._host = rep if host_kind is None else rep.with_memory_kind(host_kind)   # where payloads live
        self._zero = jax.device_put(np.zeros(self.payload_shape, self.dtype), self._host)   # scatter padding
        ids = lambda n: jax.ShapeDtypeStruct((n,), jnp.int32, sharding=rep)
        block = jax.ShapeDtypeStruct(self.payload_shape, self.dtype, sharding=self._host)
        self._gather = {n: jax.jit(_gather, in_shardings=((kv_sh, kv_sh), rep), out_shardings=(self._host,) * n)
                        .lower(kv_spec, ids(n)).compile() for n in COPY_BUCKETS}
        self._scatter = {n: jax.jit(lambda kv, i, *b: _scatter(rep, kv, i, *b), donate_argnums=(0,),
                                    in_shardings=((kv_sh, kv_sh), rep) + (self._host,) * n,
                                    out_shardings=(kv_sh, kv_sh)).lower(kv_spec, ids(n), *[block] * n).compile()
                         for n in COPY_BUCKETS}

    def gather(self, kv: KV, block_ids: list[int]) -> list[jax.Array]:
        """Dispatch reads of `block_ids`: one array per block, in `host_kind` memory or with its host transfer
        started. `landed` says when they are there; `payloads` reads them."""
        out: list[jax.Array] = []
        for start, n, bucket in _chunks(len(block_ids)):
            ids = np.zeros(bucket, np.int32)   # padding reads the null block
            ids[:n] = block_ids[start:start + n]
            blocks = self._gather[bucket](kv, jax.device_put(ids, self._rep))[:n]
            if self.host_kind is None:
                for b in blocks:
                    b.copy_to_host_async()
            out.extend(blocks)
        return out

    def scatter(self, kv: KV, block_ids: list[int], payloads: list[Payload]) -> KV:
        """Dispatch writes of `payloads` (one per block id) at `block_ids`; returns the new caches."""
        for start, n, bucket in _chunks(len(block_ids)):
            ids = np.full(bucket, self.num_blocks, np.int32)   # padding writes nowhere
            ids[:n] = block_ids[start:start + n]
            blocks = [self._on_host(p) for p in payloads[start:start + n]] + [self._zero] * (bucket - n)
            kv = self._scatter[bucket](kv, jax.device_put(ids, self._rep), *blocks)
        return kv

    def payloads(self, blocks: list[jax.Array]) -> list[Payload]:
        """A gather's blocks as the host tier keeps them (waits for the copies if need be): the pinned arrays
        themselves, or numpy arrays."""
        if self.host_kind is None:
            return [np.asarray(b) for b in blocks]
        return jax.block_until_ready(blocks)

    @staticmethod
    def landed(blocks: list[jax.Array]) -> bool:
        return all(b.is_ready() for b in blocks)

    def _on_host(self, payload: Any) -> jax.Array:
        """A payload where the scatter reads it: a pinned array as it is; numpy (disk reads) copied there."""
        if isinstance(payload, jax.Array) and payload.sharding == self._host:
            return payload
        return jax.device_put(np.asarray(payload, self.dtype), self._host)


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
