"""GGML block-quantised weight matrices, kept as a GGUF file stores them.

A quantised [N, K] matrix is a uint8 array [N, K / 32, block bytes]: each row is K / 32 blocks of
32 weights, byte for byte as in the GGUF file. The block size names the format:

    Q8_0  34 bytes: f16 d, int8 q[32]                     w = d * q
    Q4_0  18 bytes: f16 d, 16 bytes of nibbles            w = d * (q - 8)
    Q4_1  20 bytes: f16 d, f16 m, 16 bytes of nibbles     w = d * q + m

(nibbles: weight j < 16 in the low nibble of byte j, weight j + 16 in its high nibble). The CPU
GEMM kernel (cpu_gemm.cc) reads them directly; `dequantize` gives the float32 matrix, the same
values as gguf-py's dequantisation, for XLA's dot and for embedding rows. Every product d * q is
exact in float32, so w is the same whether d * q + m is fused or not.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32
FORMATS = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}   # name -> bytes per block
_BY_BYTES = {b: name for name, b in FORMATS.items()}


def format_of(w: jax.Array | np.ndarray) -> str | None:
    """The block format of a quantised matrix (or of rows gathered from one), or None for a plain
    [N, K] float one."""
    if w.dtype != np.uint8 or w.ndim != 3:
        return None
    return _BY_BYTES.get(int(w.shape[-1]))


def matrix_shape(w: jax.Array | np.ndarray) -> tuple[int, int]:
    """[N, K] of a plain or quantised matrix."""
    if format_of(w) is not None:
        return int(w.shape[0]), int(w.shape[1]) * BLOCK
    return int(w.shape[0]), int(w.shape[1])


def _f16(b: jax.Array) -> jax.Array:
    """Little-endian float16s from the last axis' byte pairs, as float32 [...]."""
    return jax.lax.bitcast_convert_type(b, jnp.float16).astype(jnp.float32)


def _nibbles(qs: jax.Array) -> jax.Array:
    """16 bytes of nibbles -> the 32 weights' 4-bit values (int32), in weight order."""
    return jnp.concatenate([qs & 15, qs >> 4], axis=-1).astype(jnp.int32)


def dequantize(w: jax.Array) -> jax.Array:
    """A quantised matrix [..., K / 32, bytes] as float32 [..., K] (also for gathered rows)."""
    fmt = format_of(w)
    if fmt == "Q8_0":
        q = jax.lax.bitcast_convert_type(w[..., 2:], jnp.int8).astype(jnp.float32)
        out = _f16(w[..., 0:2])[..., None] * q
    elif fmt == "Q4_0":
        out = _f16(w[..., 0:2])[..., None] * (_nibbles(w[..., 2:]) - 8).astype(jnp.float32)
    elif fmt == "Q4_1":
        out = _f16(w[..., 0:2])[..., None] * _nibbles(w[..., 4:]).astype(jnp.float32) + _f16(w[..., 2:4])[..., None]
    else:
        raise ValueError(f"not a quantised matrix: {w.dtype} {w.shape}")
    return out.reshape(*w.shape[:-2], w.shape[-2] * BLOCK)
