"""The float32 projection GEMM for x86-64 CPUs (cpu_gemm.cc), built on first use and called as an
XLA FFI custom call; everywhere else, and whenever it cannot be built, XLA's own dot.

`matmul_wt(x, w)` is x @ w.T for w in [out, in] layout, x float32. When JAX's default backend is a
CPU with AVX2, FMA and F16C it runs the kernel
- for float32 weights, on 2 to 64 rows (decode steps; see MIN_ROWS, MAX_ROWS);
- for narrow weights, on any number of rows, since XLA would first widen them to float32 on every
  call: bfloat16 ones (a bf16 checkpoint's matrices, `layers.exact_bf16`) and GGML blocks
  (a GGUF file's Q8_0, Q4_0 and Q4_1 matrices, `quant.py`).
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

from imp_jax.kernels_pallas import cpu_kernels, quant

log = logging.getLogger(__name__)

TARGET = "imp_gemm_f32"
TARGET_BF16W = "imp_gemm_f32_bf16w"   # float32 x, bfloat16 w
BLOCK_TARGETS = {"Q8_0": "imp_gemm_f32_q8_0w", "Q4_0": "imp_gemm_f32_q4_0w", "Q4_1": "imp_gemm_f32_q4_1w"}
_HANDLERS = {TARGET: "ImpGemmF32", TARGET_BF16W: "ImpGemmBf16W", **{
    t: f"ImpGemm{name}W" for name, t in BLOCK_TARGETS.items()}}
MIN_ROWS = 2         # one row is a memory-bound GEMV, where XLA's dot already streams at full bandwidth
MAX_ROWS = 64        # above this XLA's own GEMM (which packs the weights, amortised over many rows) is faster


@functools.cache
def available() -> bool:
    """Whether the kernel is built, loaded and registered for this CPU (built on the first call)."""
    if os.environ.get("IMP_JAX_CPU_GEMM", "auto").lower() == "xla":
        log.info("CPU GEMM kernel off (IMP_JAX_CPU_GEMM=xla): using XLA's dot")
        return False
    return all(cpu_kernels.register("cpu_gemm", target, handler) for target, handler in _HANDLERS.items())


def _target(w: jax.Array) -> str | None:
    """The kernel's custom call for this weight matrix, or None for a format it does not read."""
    if w.ndim == 2 and w.dtype in (jnp.float32, jnp.bfloat16):
        return TARGET if w.dtype == jnp.float32 else TARGET_BF16W
    fmt = quant.format_of(w)
    return BLOCK_TARGETS[fmt] if fmt else None


def _kernel(x: jax.Array, w: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct(x.shape[:-1] + w.shape[:1], jnp.float32)
    return jax.ffi.ffi_call(_target(w), out)(x, w)


def _xla(x: jax.Array, w: jax.Array) -> jax.Array:
    if quant.format_of(w) is not None:
        w = quant.dequantize(w)
    dtype = jnp.promote_types(x.dtype, w.dtype)   # float32 x with bf16 w: w widened, exactly
    return jax.lax.dot_general(x.astype(dtype), w.astype(dtype), (((x.ndim - 1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


def runs_here() -> bool:
    """Whether the kernel runs on this host: a CPU backend where it is built. Narrow weights (bf16,
    GGML blocks) of float32 models pay only here; elsewhere XLA would widen them on every call."""
    return jax.default_backend() == "cpu" and available()


def uses_kernel(x: jax.Array, w: jax.Array) -> bool:
    """Whether `matmul_wt(x, w)` runs the kernel on this host."""
    target, rows = _target(w), math.prod(x.shape[:-1])
    if x.dtype != jnp.float32 or target is None:
        return False
    if target == TARGET and not MIN_ROWS <= rows <= MAX_ROWS:
        return False
    return runs_here()


def matmul_wt(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w.T for w [N, K] (plain, or GGML blocks: quant.py), accumulated and returned
    in float32: the kernel where `uses_kernel` says so, XLA's dot otherwise."""
    if not uses_kernel(x, w):
        return _xla(x, w)
    return jax.lax.platform_dependent(x, w, cpu=_kernel, default=_xla)
