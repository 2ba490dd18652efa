"""One step's host inputs as two flat buffers: every integer (and bool) array in one int32 vector,
every float32 array in one float32 vector, so a step sends two transfers instead of one per array.

`pack` flattens a pytree of numpy arrays and records where each leaf went (a `Layout`, static and
hashable, the same for every step of a bucket); `unpack`, inside the compiled step, slices the
leaves back out with static offsets and restores their dtypes.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_INT_KINDS = {np.dtype(np.int32): "i32", np.dtype(np.uint32): "u32", np.dtype(np.bool_): "bool"}


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each leaf of the packed tree lies: (buffer, kind, offset, shape) in leaf order."""

    treedef: Any
    slots: tuple[tuple[str, str, int, tuple[int, ...]], ...]
    int_size: int
    float_size: int


def pack(tree: Any) -> tuple[Layout, np.ndarray, np.ndarray]:
    """(layout, int32 buffer, float32 buffer) holding every numpy leaf of `tree` (None leaves stay None)."""
    leaves, treedef = jax.tree.flatten(tree)
    slots, ints, floats, n_int, n_float = [], [], [], 0, 0
    for leaf in leaves:
        a = np.asarray(leaf)
        if a.dtype == np.float32:
            slots.append(("f", "f32", n_float, a.shape))
            floats.append(a.ravel())
            n_float += a.size
        elif a.dtype in _INT_KINDS:
            kind = _INT_KINDS[a.dtype]
            slots.append(("i", kind, n_int, a.shape))
            ints.append(a.view(np.int32).ravel() if kind == "u32" else a.astype(np.int32, copy=False).ravel())
            n_int += a.size
        else:
            raise TypeError(f"cannot pack a {a.dtype} step input")
    int_buf = np.concatenate(ints) if ints else np.zeros(0, np.int32)
    float_buf = np.concatenate(floats) if floats else np.zeros(0, np.float32)
    return Layout(treedef, tuple(slots), n_int, n_float), int_buf, float_buf


def unpack(layout: Layout, ints: jax.Array, floats: jax.Array) -> Any:
    """The tree `pack` flattened, as arrays of their original dtypes (traceable)."""
    leaves = []
    for buf, kind, offset, shape in layout.slots:
        size = int(np.prod(shape, dtype=np.int64))
        flat = (floats if buf == "f" else ints)[offset:offset + size]
        if kind == "u32":
            flat = jax.lax.bitcast_convert_type(flat, jnp.uint32)
        elif kind == "bool":
            flat = flat != 0
        leaves.append(flat.reshape(shape))
    return jax.tree.unflatten(layout.treedef, leaves)
