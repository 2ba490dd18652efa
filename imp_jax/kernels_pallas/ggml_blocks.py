"""GGML block-quantised weight matrices, kept as a GGUF file stores them.

A quantised [N, K] matrix is a uint8 array [N, K / W, block bytes]: each row is K / W blocks of W
weights (W = 32, or 256 for the K-quants' super-blocks), byte for byte as in the GGUF file. The
block size in bytes names the format (each is distinct):

    Q8_0   34 bytes / 32: f16 d, int8 q[32]                     w = d * q
    Q4_0   18 bytes / 32: f16 d, 16 bytes of nibbles            w = d * (q - 8)
    Q4_1   20 bytes / 32: f16 d, f16 m, 16 bytes of nibbles     w = d * q + m
    Q5_0   22 bytes / 32: f16 d, 32 high bits, 16 of nibbles    w = d * (q - 16)
    Q5_1   24 bytes / 32: f16 d, f16 m, 32 high bits, nibbles   w = d * q + m
    Q2_K   84 bytes / 256: 16 4+4-bit scale/min, 2-bit q, f16 d, f16 dmin   w = (d * sc) * q - dmin * mn
    Q3_K  110 bytes / 256: high-bit mask, 2-bit q, 16 6-bit scales, f16 d    w = (d * (sc - 32)) * q
    Q4_K  144 bytes / 256: f16 d, f16 dmin, 8 6-bit scales and mins, nibbles w = (d * sc) * q - dmin * mn
    Q5_K  176 bytes / 256: as Q4_K plus a high-bit plane                     w = (d * sc) * q - dmin * mn
    Q6_K  210 bytes / 256: low nibbles, high 2 bits, 16 int8 scales, f16 d   w = (d * sc) * (q - 32)
    IQ4_XS 136 bytes / 256: f16 d, 8 6-bit scales, nibbles indexing a table   w = (d * (sc - 32)) * table[q]
    IQ4_NL  36 bytes / 64: two 18-byte blocks, f16 d, 16 bytes of nibbles     w = d * table[q]
    MXFP4   17 bytes / 32: E8M0 e, 16 bytes of FP4 E2M1 nibbles              w = 2^(e - 128) * fp4x2[q]

A GGUF's IQ4_NL matrices (18 bytes / 32: f16 d, 16 bytes of nibbles indexing a table of 16 int8
values, w = d * table[q]) have Q4_0's block size, so the block size cannot name them: they are kept
as pairs of blocks, 36 bytes / 64 weights ("IQ4_NL" here; `iq4_nl_pairs`, a reshape of the file's
bytes), where a row's length is a multiple of 64, else held as Q8_0 (`iq4_nl_to_q8_0`: the same d
and table[q] as the int8, so the same float32 weights, at 34 bytes per 32).

MXFP4 (gpt-oss's experts; OCP microscaling) holds a power-of-two scale as a bare exponent byte (E8M0,
bias 127) and 4-bit E2M1 floats, which GGML stores doubled as int8s (fp4x2: 0, 1, 2, 3, 4, 6, 8, 12
and their negatives) under half the scale; an HF checkpoint's `*_blocks` / `*_scales` are the same
numbers in another byte order (`mxfp4_from_hf`). XLA on CPU flushes float32 subnormals to zero, so
there the weights of exponents 0 and 1 (scales below 2^-126, which no trained checkpoint has) are 0
where gguf-py keeps them subnormal.

IQ4_XS (the "i-quant" llama.cpp's imatrix releases use most) is kept under its own name: its table is
IQ4_NL's, its 32-weight sub-blocks carry 6-bit scales under one f16 d like the K-quants'.

(Q4_0 / Q4_1 / Q5_x / IQ4_NL / IQ4_XS / MXFP4 nibbles: weight j < 16 in the low nibble of byte j, weight j + 16 in its
high one; the K-quants' layouts are spelled out in `_dequantize_*`.) The CPU GEMM kernel
(cpu/gemm_exact.h) reads them directly; `dequantize` gives the float32 matrix, the same values as
gguf-py's `gguf.quants.dequantize`, for XLA's dot and for embedding rows.

Exactness: in every format the scale products d * sc and dmin * mn are exact in float32 (an f16's
11 significant bits times an integer of at most 8 bits), and so is (d * sc) * q except in Q6_K,
where it is one rounded product whichever way it is grouped (IQ4_XS's d * (sc - 32) * table[q]
is exact too: 11 + 6 + 7 significant bits; MXFP4's power of two times a 4-bit integer is exact down
to float32's subnormals, and rounds to the same inf above its range); the one add or subtract that follows
is the only other rounding. So each weight is one correctly rounded operation on exact operands:
the same float32 whether a multiply and an add are fused or not, in any grouping.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from imp_jax.kernels_pallas import ggml_x16

BLOCK = 32    # weights per block of the 32-weight formats (and per sub-block the kernel widens at a time)
QK_K = 256    # weights per K-quant super-block
FORMATS = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24,          # name -> bytes per block
           "Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "IQ4_XS": 136,
           "IQ4_NL": 36, "MXFP4": 17}
SUPER_BLOCKED = frozenset({"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"})   # 256-weight super-blocks
IQ4_NL_PAIR = 2 * BLOCK   # weights per kept IQ4_NL "block": two of the file's
WEIGHTS = {name: QK_K if name in SUPER_BLOCKED else IQ4_NL_PAIR if name == "IQ4_NL" else BLOCK
           for name in FORMATS}   # name -> weights per block
_BY_BYTES = {b: name for name, b in FORMATS.items()}
_X16_BY_BYTES = {b: name for name, b in ggml_x16.GROUP_BYTES.items()}   # the interleaved ones (ggml_x16.py)
# IQ4_NL's and IQ4_XS's non-linear 4-bit grid (llama.cpp's kvalues_iq4nl)
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
# MXFP4's E2M1 values doubled (llama.cpp's kvalues_mxfp4): code 8 is -0.0 in E2M1, 0 here
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def format_of(w: jax.Array | np.ndarray) -> str | None:
    """The block format of a quantised matrix [N, K / W, bytes] (or of rows gathered from one, or of a
    stack of them [E, N, K / W, bytes]: a mixture of experts'), or of one interleaved for the q8 GEMM
    ([N / 16, K / W, group bytes]: `Q8_0x16`, `Q5_0x16`, `Q4_Kx16`, ... ggml_x16.py); None for a plain float
    one."""
    if w.dtype != np.uint8 or w.ndim < 3:
        return None
    return _BY_BYTES.get(int(w.shape[-1])) or _X16_BY_BYTES.get(int(w.shape[-1]))


def weights_per_block(w: jax.Array | np.ndarray) -> int:
    """Weights per block of a quantised matrix (32, 64 or 256; an interleaved one's: its file format's)."""
    fmt = format_of(w)
    return WEIGHTS[ggml_x16.FORMATS[fmt][0] if fmt in ggml_x16.FORMATS else fmt]


def matrix_shape(w: jax.Array | np.ndarray) -> tuple[int, ...]:
    """[N, K] of a plain or quantised matrix ([E, N, K] of a stack of them)."""
    fmt = format_of(w)
    if fmt in ggml_x16.FORMATS:
        return (*(int(d) for d in w.shape[:-3]), int(w.shape[-3]) * ggml_x16.ROWS, int(w.shape[-2]) * weights_per_block(w))
    if fmt is not None:
        return (*(int(d) for d in w.shape[:-2]), int(w.shape[-2]) * WEIGHTS[fmt])
    return tuple(int(d) for d in w.shape)


def _f16(b: jax.Array) -> jax.Array:
    """Little-endian float16s from the last axis' byte pairs, as float32 [...]."""
    return jax.lax.bitcast_convert_type(b, jnp.float16).astype(jnp.float32)


def _nibbles(qs: jax.Array) -> jax.Array:
    """16 bytes of nibbles -> the 32 weights' 4-bit values (int32), in weight order."""
    return jnp.concatenate([qs & 15, qs >> 4], axis=-1).astype(jnp.int32)


def _bits(b: jax.Array, n: int, width: int) -> jax.Array:
    """Bytes [..., m] -> [..., n, m]: plane i is bits [width * i, width * (i + 1)) of each byte."""
    shifts = (jnp.arange(n, dtype=jnp.uint8) * width)[:, None]
    return (b[..., None, :] >> shifts) & ((1 << width) - 1)


def _high_bits32(qh: jax.Array) -> jax.Array:
    """4 bytes, a little-endian uint32 -> its 32 bits, bit j as weight j's (int32)."""
    return _bits(qh, 8, 1).swapaxes(-1, -2).reshape(*qh.shape[:-1], 32).astype(jnp.int32)


def _scales_mins_k4(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Q4_K / Q5_K's 12 scale bytes -> 8 6-bit scales and 8 6-bit mins (float32). Bytes 0-3 hold
    scales 0-3 in their low 6 bits, 4-7 mins 0-3; scales / mins 4-7 are the low / high nibbles of
    bytes 8-11 with the top 2 bits of bytes 0-3 / 4-7 above them."""
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = jnp.concatenate([lo & 63, (hi & 15) | ((lo >> 2) & 48)], axis=-1)
    mn = jnp.concatenate([mid & 63, (hi >> 4) | ((mid >> 2) & 48)], axis=-1)
    return sc.astype(jnp.float32), mn.astype(jnp.float32)


def _dequantize_q4_k(b: jax.Array) -> jax.Array:
    """[n, 144] -> [n, 256]: f16 d, f16 dmin, 12 scale bytes, 128 bytes of nibbles. Sub-block j
    (32 weights) is the low (j even) or high nibbles of bytes 32 * (j // 2) ..."""
    sc, mn = _scales_mins_k4(b[:, 4:16])
    d = _f16(b[:, 0:2])[:, None] * sc                       # [n, 8], exact
    dm = _f16(b[:, 2:4])[:, None] * mn
    q = _bits(b[:, 16:].reshape(-1, 4, 32), 2, 4).reshape(-1, 8, 32).astype(jnp.float32)
    return (d[..., None] * q - dm[..., None]).reshape(-1, QK_K)


def _dequantize_q5_k(b: jax.Array) -> jax.Array:
    """[n, 176] -> [n, 256]: Q4_K's fields, then 32 bytes of high bits (bit j of byte i: weight
    32 * j + i's fifth bit) before the nibbles."""
    sc, mn = _scales_mins_k4(b[:, 4:16])
    d = _f16(b[:, 0:2])[:, None] * sc
    dm = _f16(b[:, 2:4])[:, None] * mn
    low = _bits(b[:, 48:].reshape(-1, 4, 32), 2, 4).reshape(-1, 8, 32)
    high = _bits(b[:, 16:48], 8, 1)                         # [n, 8, 32]
    q = (low | (high << 4)).astype(jnp.float32)
    return (d[..., None] * q - dm[..., None]).reshape(-1, QK_K)


def _dequantize_q6_k(b: jax.Array) -> jax.Array:
    """[n, 210] -> [n, 256]: 128 bytes of low nibbles (per half of 128 weights: 64 bytes, low
    nibbles then high), 64 bytes of 2-bit high parts (per half: 32 bytes, 4 planes), 16 int8
    scales (one per 16 weights), f16 d."""
    low = _bits(b[:, 0:128].reshape(-1, 2, 64), 2, 4).reshape(-1, 8, 32)
    high = _bits(b[:, 128:192].reshape(-1, 2, 32), 4, 2).reshape(-1, 8, 32)
    q = ((low | (high << 4)).astype(jnp.int32) - 32).astype(jnp.float32).reshape(-1, 16, 16)
    sc = jax.lax.bitcast_convert_type(b[:, 192:208], jnp.int8).astype(jnp.float32)
    d = _f16(b[:, 208:210])[:, None] * sc                   # [n, 16], exact
    return (d[..., None] * q).reshape(-1, QK_K)


def _dequantize_q3_k(b: jax.Array) -> jax.Array:
    """[n, 110] -> [n, 256]: 32 bytes of high-bit mask (bit j of byte i: weight 32 * j + i; a
    clear bit subtracts 4), 64 bytes of 2-bit parts (per half: 32 bytes, 4 planes), 12 bytes of
    16 6-bit scales (low nibbles in bytes 0-7, low then high nibble; 2 high bits in bytes 8-11,
    4 planes), f16 d."""
    s = b[:, 96:108]
    low = _bits(s[:, 0:8], 2, 4).reshape(-1, 16)
    high = _bits(s[:, 8:12], 4, 2).reshape(-1, 16)
    sc = ((low | (high << 4)).astype(jnp.int32) - 32).astype(jnp.float32)
    d = _f16(b[:, 108:110])[:, None] * sc                   # [n, 16], exact
    ql = _bits(b[:, 32:96].reshape(-1, 2, 32), 4, 2).reshape(-1, 8, 32).astype(jnp.int32)
    hm = _bits(b[:, 0:32], 8, 1).astype(jnp.int32)          # [n, 8, 32]
    q = (ql - 4 * (1 - hm)).astype(jnp.float32).reshape(-1, 16, 16)
    return (d[..., None] * q).reshape(-1, QK_K)


def _dequantize_q2_k(b: jax.Array) -> jax.Array:
    """[n, 84] -> [n, 256]: 16 scale bytes (low nibble scale, high nibble min, per 16 weights),
    64 bytes of 2-bit q (per half: 32 bytes, 4 planes), f16 d, f16 dmin."""
    s = b[:, 0:16]
    dl = _f16(b[:, 80:82])[:, None] * (s & 15).astype(jnp.float32)   # [n, 16], exact
    ml = _f16(b[:, 82:84])[:, None] * (s >> 4).astype(jnp.float32)
    q = _bits(b[:, 16:80].reshape(-1, 2, 32), 4, 2).reshape(-1, 16, 16).astype(jnp.float32)
    return (dl[..., None] * q - ml[..., None]).reshape(-1, QK_K)


def _dequantize_iq4_xs(b: jax.Array) -> jax.Array:
    """[n, 136] -> [n, 256]: f16 d, a little-endian uint16 of the 8 scales' high 2 bits (scale j:
    bits 2j, 2j + 1), 4 bytes of their low nibbles (scale j: byte j // 2, low nibble for even j),
    then per 32-weight sub-block 16 bytes of nibbles (weight i < 16 low, i + 16 high) indexing
    IQ4_NL_VALUES. Scales are 6-bit, minus 32."""
    high = _bits(b[:, 2:4], 4, 2).swapaxes(-1, -2).reshape(-1, 8)          # byte 2's 4 pairs, then byte 3's
    low = _bits(b[:, 4:8], 2, 4).swapaxes(-1, -2).reshape(-1, 8)
    sc = ((low | (high << 4)).astype(jnp.int32) - 32).astype(jnp.float32)
    d = _f16(b[:, 0:2])[:, None] * sc                                       # [n, 8], exact
    q = jnp.asarray(IQ4_NL_VALUES, jnp.float32)[_nibbles(b[:, 8:].reshape(-1, 8, 16))]
    return (d[..., None] * q).reshape(-1, QK_K)


def _e8m0_half(e: jax.Array) -> jax.Array:
    """E8M0 exponent bytes -> 2^(e - 128) as float32 (subnormal for e < 2), as GGML's
    ggml_e8m0_to_fp32_half builds it from bits."""
    e = e.astype(jnp.uint32)
    bits = jnp.where(e < 2, jnp.uint32(0x00200000) << e, (e - 1) << 23)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


_K_QUANTS = {"Q2_K": _dequantize_q2_k, "Q3_K": _dequantize_q3_k, "Q4_K": _dequantize_q4_k,
             "Q5_K": _dequantize_q5_k, "Q6_K": _dequantize_q6_k, "IQ4_XS": _dequantize_iq4_xs}


def dequantize(w: jax.Array) -> jax.Array:
    """A quantised matrix [..., K / W, bytes] as float32 [..., K] (also for gathered rows; an interleaved
    one [N / 16, K / W, group bytes] as [N, K])."""
    fmt = format_of(w)
    if fmt in ggml_x16.FORMATS:
        return dequantize(ggml_x16.deinterleave(w, fmt))
    if fmt == "Q8_0":
        q = jax.lax.bitcast_convert_type(w[..., 2:], jnp.int8).astype(jnp.float32)
        out = _f16(w[..., 0:2])[..., None] * q
    elif fmt == "Q4_0":
        out = _f16(w[..., 0:2])[..., None] * (_nibbles(w[..., 2:]) - 8).astype(jnp.float32)
    elif fmt == "Q4_1":
        out = _f16(w[..., 0:2])[..., None] * _nibbles(w[..., 4:]).astype(jnp.float32) + _f16(w[..., 2:4])[..., None]
    elif fmt == "Q5_0":
        q = _nibbles(w[..., 6:]) | (_high_bits32(w[..., 2:6]) << 4)
        out = _f16(w[..., 0:2])[..., None] * (q - 16).astype(jnp.float32)
    elif fmt == "Q5_1":
        q = _nibbles(w[..., 8:]) | (_high_bits32(w[..., 4:8]) << 4)
        out = _f16(w[..., 0:2])[..., None] * q.astype(jnp.float32) + _f16(w[..., 2:4])[..., None]
    elif fmt == "IQ4_NL":   # pairs of (f16 d, 16 bytes of nibbles)
        b = w.reshape(*w.shape[:-1], 2, IQ4_NL_BYTES)
        out = _f16(b[..., 0:2])[..., None] * jnp.asarray(IQ4_NL_VALUES, jnp.float32)[_nibbles(b[..., 2:])]
    elif fmt == "MXFP4":
        out = _e8m0_half(w[..., 0])[..., None] * jnp.asarray(MXFP4_VALUES, jnp.float32)[_nibbles(w[..., 1:])]
    elif fmt in _K_QUANTS:
        out = _K_QUANTS[fmt](w.reshape(-1, w.shape[-1]))
    else:
        raise ValueError(f"not a quantised matrix: {w.dtype} {w.shape}")
    return out.reshape(*w.shape[:-2], w.shape[-2] * WEIGHTS[fmt])


# Formats whose every weight is d * (q - c) with q - c in int8 range: Q8_0 holds them exactly.
WIDENS_TO_Q8_0 = frozenset({"Q8_0", "Q4_0", "Q5_0"})


def to_q8_0(w: np.ndarray) -> np.ndarray:
    """A Q4_0 / Q5_0 / Q8_0 matrix [N, K / 32, bytes] (host bytes) as Q8_0 blocks [N, K / 32, 34]
    holding the same weights: the same f16 d, and q - 8 / q - 16 as int8, so every weight dequantises
    (and widens in the GEMM kernel) to the same float32, d times the same integer. Used where a fused
    matrix joins parts stored in different formats (llama.cpp's Q4_K_M gives attn_v a wider type)."""
    fmt = format_of(w)
    if fmt == "Q8_0":
        return w
    w = np.asarray(w)
    nib = np.concatenate([w[..., -16:] & 15, w[..., -16:] >> 4], axis=-1).astype(np.int16)   # weight order
    if fmt == "Q4_0":
        q = nib - 8
    elif fmt == "Q5_0":
        qh = w[..., 2:6].copy().view("<u4")                                          # [..., 1]
        high = (qh >> np.arange(32, dtype=np.uint32)) & 1
        q = (nib | (high.astype(np.int16) << 4)) - 16
    else:
        raise ValueError(f"{fmt} blocks cannot be held exactly as Q8_0")
    return _q8_0_blocks(w[..., 0:2], q)


IQ4_NL_BYTES = 18


def iq4_nl_pairs(w: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks [N, K / 32, 18] as kept, [N, K / 64, 36] (K a multiple of 64): the same bytes."""
    w = np.asarray(w)
    if w.dtype != np.uint8 or w.shape[-1] != IQ4_NL_BYTES or w.shape[-2] % 2:
        raise ValueError(f"not IQ4_NL blocks of rows a multiple of 64 weights: {w.dtype} {w.shape}")
    return w.reshape(*w.shape[:-2], w.shape[-2] // 2, FORMATS["IQ4_NL"])


def iq4_nl_to_q8_0(w: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks [N, K / 32, 18] (host bytes) as Q8_0 blocks [N, K / 32, 34] holding the same
    weights: each weight is d * IQ4_NL_VALUES[q], an f16 times an int8, which a Q8_0 block stores
    as is; gguf-py and the GEMM kernel both compute that one float32 product. For rows whose length
    is not a multiple of 64 (`iq4_nl_pairs` keeps the others at their own 4.5 bits)."""
    w = np.asarray(w)
    if w.dtype != np.uint8 or w.shape[-1] != IQ4_NL_BYTES:
        raise ValueError(f"not IQ4_NL blocks: {w.dtype} {w.shape}")
    nib = np.concatenate([w[..., 2:] & 15, w[..., 2:] >> 4], axis=-1)   # weight order
    return _q8_0_blocks(w[..., 0:2], IQ4_NL_VALUES[nib])


def _q8_0_blocks(d: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q8_0 blocks from f16 scale bytes [..., 2] and integer weights [..., 32] in int8 range."""
    out = np.empty((*q.shape[:-1], FORMATS["Q8_0"]), np.uint8)
    out[..., 0:2] = d
    out[..., 2:] = q.astype(np.int8).view(np.uint8)
    return out


def mxfp4_from_hf(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 as HF checkpoints (gpt-oss) store it, blocks uint8 [..., G, 16] (value 2i in the low
    nibble of byte i, 2i + 1 in the high) and E8M0 scales uint8 [..., G], as GGML MXFP4 blocks
    [..., G, 17]: the same exponent byte and the same 4-bit codes (E2M1 and GGML's doubled table index
    alike), moved so that value j < 16 is the low nibble of byte j, j + 16 the high. No arithmetic:
    every weight dequantises to the value 2^(e - 127) * e2m1[q] it had (-0.0 as +0.0)."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape}: expected [..., G, 16] and [..., G]")
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)   # value order
    out = np.empty((*scales.shape, FORMATS["MXFP4"]), np.uint8)
    out[..., 0] = scales
    out[..., 1:] = codes[..., :16] | (codes[..., 16:] << 4)
    return out
