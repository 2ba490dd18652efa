"""Where the engine's arrays live: a device mesh, and the map from logical axis names to its axes.

Parameters and the KV cache name their axes (model/base.py: `axes` metadata, KV_CACHE_AXES); the
compiled step takes explicit shardings built here. Today the mesh holds one device, so every
sharding is trivial; tensor parallelism shards the names in RULES over the mesh's "tp" axis (the
fused `qkv` and `gate_up` axes then need a shard-major row order, which the loader must write).
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from imp_jax.model.base import KV_CACHE_AXES

TP = "tp"
RULES: dict[str, str] = {"vocab": TP, "heads": TP, "kv_heads": TP, "mlp": TP, "qkv": TP, "gate_up": TP}


def make_mesh(devices: Sequence[Any]) -> Mesh:
    """A one-axis ("tp") mesh over `devices`; one device until tensor parallelism lands."""
    if len(devices) != 1:
        raise ValueError(f"the engine runs on one device; got {len(devices)}")
    return Mesh(np.asarray(devices).reshape(len(devices)), (TP,))


def default_mesh() -> Mesh:
    """A mesh of the default backend's first local device: what one engine runs on today."""
    return make_mesh(jax.local_devices()[:1])


def replica_devices(replica: int, replicas: int, per_replica: int = 1) -> list[Any]:
    """The local devices of data-parallel replica `replica` of `replicas`: disjoint groups of `per_replica`
    devices in device order. Fewer local devices than the replicas need is a ValueError that says how
    to get more on CPU (fake devices are never made behind the operator's back)."""
    devices = jax.local_devices()
    need = replicas * per_replica
    if len(devices) < need:
        platform = devices[0].platform if devices else "no"
        hint = (f"; on CPU, ask for fake devices before start-up: "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={need}") if platform == "cpu" else ""
        raise ValueError(f"--data-parallel-size {replicas} needs {need} devices; this host has "
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
