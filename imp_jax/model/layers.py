"""Small pure building blocks shared by model definitions: projection, RMSNorm, RoPE."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from imp_jax.kernels_pallas import cpu_gemm, quant


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None, *,
           out_dtype: jnp.dtype | None = None) -> jax.Array:
    """x @ w.T (+ b) for w in [out, in] layout (HF's, torch's), accumulated in float32 and returned
    as `out_dtype` (default: x's). Every projection and the LM head go through here, so LoRA deltas
    and quantised weights have one home.

    float32 products of up to `cpu_gemm.MAX_ROWS` rows (decode steps) run the CPU GEMM kernel on
    x86-64 CPUs (kernels_pallas/cpu_gemm.py); larger ones, other dtypes and platforms, XLA's dot.
    """
    y = cpu_gemm.matmul_wt(x, w)
    if b is not None:
        y = y + b
    return y.astype(out_dtype or x.dtype)


def embed(table: jax.Array, ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Rows `ids` of an embedding table (plain, or GGML blocks: only the gathered rows are
    dequantised) as `dtype`."""
    rows = table[ids]
    if quant.format_of(table) is not None:
        rows = quant.dequantize(rows)
    return rows.astype(dtype)


def keeps_blocks(dtype: jnp.dtype) -> bool:
    """Whether a model computing in `dtype` keeps a GGUF's GGML-block matrices as blocks on this
    host: float32, where the CPU GEMM kernel reads blocks (`cpu_gemm.runs_here`). The products are
    those of the dequantised matrices, from a quarter to a seventh of the bytes."""
    return jnp.dtype(dtype) == jnp.float32 and cpu_gemm.runs_here()


def join_blocks(parts: list[np.ndarray | None]) -> np.ndarray | None:
    """One matrix of `parts` (each a tensor's GGML blocks, or None where it has none the kernel
    reads), concatenated along the output axis when they share one format; None: dequantise."""
    if any(p is None for p in parts) or len({quant.format_of(p) for p in parts}) != 1:
        return None
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def exact_bf16(w: jax.Array) -> jax.Array:
    """A float32 matrix for `linear` as bfloat16 when that loses nothing and pays here: every value
    is a bfloat16 (the matrix came from a bf16 checkpoint) and the CPU GEMM kernel, which widens
    bf16 weights to float32 as it reads them, runs on this host. The products are the same bits,
    the matrix takes half the memory, and a decode step reads half the bytes. Otherwise `w` as is
    (XLA's own dot would copy a bf16 matrix to float32 on every call)."""
    if w.dtype != jnp.float32 or w.ndim != 2 or not cpu_gemm.runs_here():
        return w
    bits = np.asarray(w).view(np.uint32)
    if np.any(bits & 0xFFFF):
        return w
    return jnp.asarray(w, jnp.bfloat16)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in float32."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * w.astype(jnp.float32)).astype(x.dtype)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos/sin [T, head_dim // 2] for integer positions."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [T, heads, D] by position, HF `rotate_half` layout (first half / second half)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)
