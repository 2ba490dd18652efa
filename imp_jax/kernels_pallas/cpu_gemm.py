"""The float32 projection GEMM for x86-64 CPUs (cpu_gemm.cc), built on first use and called as an
XLA FFI custom call; everywhere else, and whenever it cannot be built, XLA's own dot.

`matmul_wt(x, w)` is x @ w.T for w in [out, in] layout. When JAX's default backend is a CPU with
AVX2 and FMA it runs the kernel for 2 to 64 rows (decode steps; see MIN_ROWS, MAX_ROWS); the
program lowers to XLA's dot on any other platform it is compiled for (`platform_dependent`), and
GPU hosts never build the kernel.
The kernel is built on first use (cpu_kernels.py). Set IMP_JAX_CPU_GEMM=xla to use XLA's dot on
the CPU too.
"""
from __future__ import annotations

import functools
import logging
import math
import os

import jax
import jax.numpy as jnp

from imp_jax.kernels_pallas import cpu_kernels

log = logging.getLogger(__name__)

TARGET = "imp_gemm_f32"
MIN_ROWS = 2         # one row is a memory-bound GEMV, where XLA's dot already streams at full bandwidth
MAX_ROWS = 64        # above this XLA's own GEMM (which packs the weights, amortised over many rows) is faster


@functools.cache
def available() -> bool:
    """Whether the kernel is built, loaded and registered for this CPU (built on the first call)."""
    if os.environ.get("IMP_JAX_CPU_GEMM", "auto").lower() == "xla":
        log.info("CPU GEMM kernel off (IMP_JAX_CPU_GEMM=xla): using XLA's dot")
        return False
    return cpu_kernels.register("cpu_gemm", TARGET, "ImpGemmF32")


def _kernel(x: jax.Array, w: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct(x.shape[:-1] + w.shape[:1], jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(x, w)


def _xla(x: jax.Array, w: jax.Array) -> jax.Array:
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def matmul_wt(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w.T for w [N, K], accumulated and returned in float32: the kernel for float32
    operands of MIN_ROWS to MAX_ROWS rows on CPUs that have it, XLA's dot otherwise."""
    rows = math.prod(x.shape[:-1])
    if (x.dtype != jnp.float32 or w.dtype != jnp.float32 or w.ndim != 2 or not MIN_ROWS <= rows <= MAX_ROWS
            or jax.default_backend() != "cpu" or not available()):
        return _xla(x, w)
    return jax.lax.platform_dependent(x, w, cpu=_kernel, default=_xla)
