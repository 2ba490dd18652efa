"""Per-row LoRA deltas for x86-64 CPUs (lora.cc), called as an XLA FFI custom call.

`lora_delta_cpu(x, ids, a, bt, parts)` is, for each row t of x, B[s] A[s] x[t] with s = ids[t] (0 =
no adapter: a zero row), the slabs in model/lora.py's layout. Each row multiplies its own slot's
matrices only, where the XLA formulation multiplies every slot's and masks. float32 rows; float32 or
float16 slabs (the engine's choice on a CPU: half the bytes a decode step streams); built on first
use (build.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from imp_jax.kernels_pallas.cpu import build

TARGETS = {jnp.dtype(jnp.float32): "imp_lora_f32", jnp.dtype(jnp.float16): "imp_lora_f16"}
_HANDLERS = {"imp_lora_f32": "ImpLoraF32", "imp_lora_f16": "ImpLoraF16"}


def available() -> bool:
    """Whether the kernel is built, loaded and registered for this CPU (built on the first call)."""
    return all(build.register("lora", target, handler) for target, handler in _HANDLERS.items())


def takes(x: jax.Array, a: jax.Array, bt: jax.Array) -> bool:
    """Whether the kernel reads these operands: float32 rows, float32 or float16 slabs (both alike)."""
    return (x.ndim == 2 and x.dtype == jnp.float32 and a.dtype == bt.dtype and jnp.dtype(a.dtype) in TARGETS
            and available())


def lora_delta_cpu(x: jax.Array, ids: jax.Array, a: jax.Array, bt: jax.Array, parts: tuple[int, ...]) -> jax.Array:
    """float32 [T, sum(parts)]: row t's delta under slot ids[t] (x [T, K], a [N, P * R, K], bt [N, R, O])."""
    call = jax.ffi.ffi_call(TARGETS[jnp.dtype(a.dtype)], jax.ShapeDtypeStruct((x.shape[0], bt.shape[2]), jnp.float32))
    return call(x, ids.astype(jnp.int32), a, bt, parts=np.asarray(parts, np.int64))
