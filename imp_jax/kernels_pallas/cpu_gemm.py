"""The float32 projection GEMM for x86-64 CPUs (cpu_gemm.cc), built on first use and called as an
XLA FFI custom call; everywhere else, and whenever it cannot be built, XLA's own dot.

`matmul_wt(x, w)` is x @ w.T for w in [out, in] layout, x float32. When JAX's default backend is a
CPU with AVX2 and FMA it runs the kernel
- for float32 weights, on 2 to 64 rows (decode steps; see MIN_ROWS, MAX_ROWS);
- for bfloat16 weights (a bf16 checkpoint's matrices kept at half the bytes, see
  `layers.exact_bf16`), on any number of rows, since XLA would first copy them to float32.
The program lowers to XLA's dot on any other platform it is compiled for (`platform_dependent`),
and GPU hosts never build the kernel.
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
TARGET_BF16W = "imp_gemm_f32_bf16w"   # float32 x, bfloat16 w
MIN_ROWS = 2         # one row is a memory-bound GEMV, where XLA's dot already streams at full bandwidth
MAX_ROWS = 64        # above this XLA's own GEMM (which packs the weights, amortised over many rows) is faster


@functools.cache
def available() -> bool:
    """Whether the kernel is built, loaded and registered for this CPU (built on the first call)."""
    if os.environ.get("IMP_JAX_CPU_GEMM", "auto").lower() == "xla":
        log.info("CPU GEMM kernel off (IMP_JAX_CPU_GEMM=xla): using XLA's dot")
        return False
    return (cpu_kernels.register("cpu_gemm", TARGET, "ImpGemmF32")
            and cpu_kernels.register("cpu_gemm", TARGET_BF16W, "ImpGemmBf16W"))


def _kernel(x: jax.Array, w: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct(x.shape[:-1] + w.shape[:1], jnp.float32)
    return jax.ffi.ffi_call(TARGET if w.dtype == jnp.float32 else TARGET_BF16W, out)(x, w)


def _xla(x: jax.Array, w: jax.Array) -> jax.Array:
    dtype = jnp.promote_types(x.dtype, w.dtype)   # float32 x with bf16 w: w widened, exactly
    return jax.lax.dot_general(x.astype(dtype), w.astype(dtype), (((x.ndim - 1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


def uses_kernel(x_dtype: jnp.dtype, w_dtype: jnp.dtype, rows: int) -> bool:
    """Whether `matmul_wt` runs the kernel for these operands on this host."""
    if x_dtype != jnp.float32 or jax.default_backend() != "cpu":
        return False
    if w_dtype == jnp.float32:
        fits = MIN_ROWS <= rows <= MAX_ROWS
    else:
        fits = w_dtype == jnp.bfloat16 and rows >= 1
    return fits and available()


def matmul_wt(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w.T for w [N, K], accumulated and returned in float32: the kernel where
    `uses_kernel` says so, XLA's dot otherwise."""
    if w.ndim != 2 or not uses_kernel(x.dtype, w.dtype, math.prod(x.shape[:-1])):
        return _xla(x, w)
    return jax.lax.platform_dependent(x, w, cpu=_kernel, default=_xla)
