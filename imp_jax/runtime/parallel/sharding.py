"""Where the engine's arrays live: a device mesh, and the map from logical axis names to its axes.

Parameters and the KV cache name their axes (model/base.py: `axes` metadata, KV_CACHE_AXES); the
compiled step takes explicit shardings built here. On one device every sharding is whole; with
tensor parallelism the names in RULES are split over the mesh's "tp" axis (the fused `qkv` and
`gate_up` axes are stored shard-major by the loader: model/tensor_parallel.py) and the step runs the
model per shard under `shard_map` (runtime/execution/step.py).
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from imp_jax.model.base import KV_CACHE_AXES
from imp_jax.model.tensor_parallel import AXIS

TP = AXIS
RULES: dict[str, str] = {"vocab": TP, "heads": TP, "kv_heads": TP, "mlp": TP, "qkv": TP, "gate_up": TP}


def make_mesh(devices: Sequence[Any]) -> Mesh:
    """A one-axis ("tp") mesh over `devices`."""
    if not devices:
        raise ValueError("a mesh needs at least one device")
    return Mesh(np.asarray(devices).reshape(len(devices)), (TP,))


def default_mesh() -> Mesh:
    """A mesh of the default backend's first local device: what one engine runs on without TP."""
    return make_mesh(jax.local_devices()[:1])


def replica_devices(replica: int, replicas: int, per_replica: int = 1) -> list[Any]:
    """The local devices of data-parallel replica `replica` of `replicas`: disjoint groups of `per_replica`
    (--tensor-parallel-size) devices in device order. Fewer local devices than that needs is a ValueError
    naming the flags and, on CPU, how to get fake devices (never made behind the operator's back)."""
    devices = jax.local_devices()
    need = replicas * per_replica
    if per_replica < 1 or len(devices) < need:
        platform = devices[0].platform if devices else "no"
        flags = " x ".join(f for f, n in ((f"--data-parallel-size {replicas}", replicas),
                                          (f"--tensor-parallel-size {per_replica}", per_replica)) if n != 1)
        hint = (f"; on CPU, ask for fake devices before start-up: "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={need}") if platform == "cpu" else ""
        raise ValueError(f"{flags or '--tensor-parallel-size 0'} needs {need} devices; this host has "
                         f"{len(devices)} {platform} device(s){hint}")
    return devices[replica * per_replica:(replica + 1) * per_replica]


def partition_spec(axes: Sequence[str | None] | None, ndim: int) -> PartitionSpec:
    """The mesh axes of an array whose leading axes are named `axes` (trailing ones, such as a GGML
    block's bytes, and unnamed ones are replicated)."""
    names = list(axes or ())[:ndim]
    return PartitionSpec(*(RULES.get(a) if a else None for a in names), *([None] * (ndim - len(names))))


def state_shardings(state: nnx.State, mesh: Mesh) -> Any:
    """A NamedSharding per parameter of `state` (a pytree prefix of it), from its `axes` metadata."""
    def one(v: nnx.Variable) -> NamedSharding:
        value = v.get_value()
        return NamedSharding(mesh, partition_spec(v.get_metadata().get("axes"), value.ndim))
    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def kv_sharding(mesh: Mesh) -> NamedSharding:
    """The sharding of K (and of V): by kv head."""
    return NamedSharding(mesh, partition_spec(KV_CACHE_AXES, len(KV_CACHE_AXES)))


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array: step inputs, sampler outputs."""
    return NamedSharding(mesh, PartitionSpec())
