"""Small pure building blocks shared by model definitions: projection, embedding, RMSNorm, LayerNorm, RoPE, M-RoPE."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from imp_jax.kernels_pallas import XLA, Kernels, ggml_blocks, ggml_x16, matmul_wt
from imp_jax.model.lora import LoraDelta


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None, *, kernels: Kernels = XLA,
           out_dtype: jnp.dtype | None = None, lora: LoraDelta | None = None) -> jax.Array:
    """x @ w.T (+ b) for w in [out, in] layout (HF's, torch's), accumulated in float32 and returned
    as `out_dtype` (default: x's). Every projection and the LM head go through here, so the
    weights' storage formats (model/weights.py) and LoRA deltas have one home. `kernels` picks
    the GEMM (kernels_pallas/gemm.py); `lora` adds each row's low-rank delta in float32, whatever
    format w is stored in (model/lora.py)."""
    y = matmul_wt(x, w, kernels)
    if lora is not None:
        y = y + lora(x, kernels)
    if b is not None:
        y = y + b
    return y.astype(out_dtype or x.dtype)


def embed(table: jax.Array, ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Rows `ids` of an embedding table (plain, or GGML blocks: only the gathered rows are
    dequantised) as `dtype`."""
    fmt = ggml_blocks.format_of(table)
    rows = ggml_x16.rows_of(table, fmt, ids) if fmt in ggml_x16.FORMATS else table[ids]
    if fmt is not None:
        rows = ggml_blocks.dequantize(rows)
    return rows.astype(dtype)


def override_rows(x: jax.Array, rows: jax.Array, slots: jax.Array) -> jax.Array:
    """x [T, E] with row slots[m] replaced by rows[m] ([M, E], [M] int32): image embeddings over their
    placeholder tokens. A slot >= T (padding up to the bucketed M) writes nowhere."""
    return x.at[slots].set(rows.astype(x.dtype), mode="drop")


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in float32; a row's bits do not depend on the other rows
    (row_sum)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(row_sum(xf * xf) / xf.shape[-1] + eps)
    return (xf * w.astype(jnp.float32)).astype(x.dtype)


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis, computed in float32 (the encoders: BERT, the SigLIP vision tower)."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + eps) * w + b).astype(x.dtype)


def row_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis (kept, of size 1) in an order fixed by its length alone: halves added
    while the length is even (after zero padding to a multiple of 16), then the rest one by one.
    Elementwise adds only: XLA's own reductions change their order with the number of rows (on a
    CPU, rows of 1-5 get other bits than rows of 8+), and a step must give a row the same result
    whatever its batch, which the int8-activation GEMM would otherwise amplify into other tokens."""
    if x.shape[-1] % 16:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, 16 - x.shape[-1] % 16)])
    while x.shape[-1] % 2 == 0:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    out = x[..., :1]
    for j in range(1, x.shape[-1]):
        out = out + x[..., j:j + 1]
    return out


def rope_tables(positions: jax.Array, inv_freq: np.ndarray, scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """cos/sin [T, rotary_dim // 2] for integer positions, times `scale` (longrope's attention factor)."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    if scale == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def mrope_tables(positions: jax.Array, inv_freq: np.ndarray, sections: tuple[int, ...],
                 scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """cos/sin [T, rotary_dim // 2] for multimodal positions [len(sections), T] (Qwen2-VL's M-RoPE): the
    first sections[0] frequencies turn with component 0 (temporal), the next sections[1] with component 1
    (height), the rest with component 2 (width), as transformers recomposes them."""
    if positions.ndim != 2 or positions.shape[0] != len(sections) or sum(sections) != len(inv_freq):
        raise ValueError(f"positions {positions.shape} do not fit M-RoPE sections {sections} over "
                         f"{len(inv_freq)} frequencies")
    component = np.repeat(np.arange(len(sections)), sections)   # each frequency's position component
    angles = positions.astype(jnp.float32)[component].T * jnp.asarray(inv_freq, jnp.float32)[None, :]
    if scale == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [T, heads, D] by position, HF `rotate_half` layout (first half / second half) over
    its first 2 * cos.shape[-1] dims; the rest pass through (partial rotary, Phi-4-mini)."""
    half = cos.shape[-1]
    rot, rest = x[..., :2 * half], x[..., 2 * half:]
    x1, x2 = rot[..., :half].astype(jnp.float32), rot[..., half:].astype(jnp.float32)
    c, s = cos[:, None, :], sin[:, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)
    return out if rest.shape[-1] == 0 else jnp.concatenate([out, rest], axis=-1)
