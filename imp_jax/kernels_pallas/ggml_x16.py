"""GGML blocks interleaved 16 rows at a time for the q8 GEMM's AVX-512 tiles (cpu/gemm_q8_x16.h).

A Q8_0, Q5_0, Q4_0, Q4_1, Q4_K, Q6_K, IQ4_XS or IQ4_NL matrix [N, K / W, bytes] (N a multiple of 16) becomes groups
[N / 16, K / W, group bytes]: group g's block b holds block b of rows 16g..16g+15, arranged so that one 64-byte load
gives the same 4 weights of all 16 rows (gemm_q8_x16.h spells the byte order out). The numbers are the file's, byte
for byte up to that order, except that Q8_0's int8s are stored plus 128 (the kernel's unsigned operand), Q4_K's
6-bit scales and mins take a byte each (4 bytes a super-block more than the file's 144), IQ4_XS's 6-bit scales a
byte each less 32 (2 more than the file's 136), IQ4_NL's kept pairs of blocks (ggml_blocks.py) stay pairs, and
Q6_K's 6-bit weights are regrouped into nibbles and 2-bit planes. `interleave` runs at load (NumPy); `deinterleave`
gives the file's blocks back (JAX, inside programs: `ggml_blocks.dequantize` and the embedding rows of a tied table
go through it), so every other reader of the matrix sees the file's blocks. The loader writes these only for `--gemm
cpu_q8` on a CPU with the AVX-512 path (model/weights.py `interleave_for_q8`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

ROWS = 16                                           # weight rows per group
# name -> (the file's format, bytes a group of 16 rows takes per block: the file's 16 blocks, plus Q4_K's 6-bit
# scales and mins and IQ4_XS's 6-bit scales as a byte each); a block's weights are its file format's
# (ggml_blocks.WEIGHTS: IQ4_NL's kept pairs 64)
FORMATS = {"Q8_0x16": ("Q8_0", 544), "Q5_0x16": ("Q5_0", 352), "Q4_0x16": ("Q4_0", 288), "Q4_1x16": ("Q4_1", 320),
           "Q4_Kx16": ("Q4_K", 2368), "Q6_Kx16": ("Q6_K", 3360), "IQ4_XSx16": ("IQ4_XS", 2208),
           "IQ4_NLx16": ("IQ4_NL", 576)}
OF = {base: name for name, (base, _) in FORMATS.items()}        # the file's format -> its interleaved name
GROUP_BYTES = {name: nbytes for name, (_, nbytes) in FORMATS.items()}


def _scales_mins_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes [..., 12] as its 8 6-bit scales and 8 mins [..., 8] (uint8; ggml's get_scale_min_k4)."""
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return sc, mn


def _q6_k_weights(b: np.ndarray) -> np.ndarray:
    """Q6_K super-blocks [..., 210] as their 256 6-bit integers q [..., 256] (uint8; w = d * sc * (q - 32)): per
    128 weights h, 64 bytes of low nibbles (weights 32k + l: byte l of the first 32 for k = 0 low, 2 high; of
    the next 32 for k = 1, 3) and 32 of high 2-bit pairs (bits 2k of byte l)."""
    q = np.empty((*b.shape[:-1], 2, 4, 32), np.uint8)
    for h in range(2):
        l0, l1, hb = b[..., 64 * h:64 * h + 32], b[..., 64 * h + 32:64 * h + 64], b[..., 128 + 32 * h:160 + 32 * h]
        for k, low in enumerate([l0 & 15, l1 & 15, l0 >> 4, l1 >> 4]):
            q[..., h, k, :] = low | (((hb >> (2 * k)) & 3) << 4)
    return q.reshape(*b.shape[:-1], 256)


def interleave(blocks: np.ndarray, fmt: str) -> np.ndarray:
    """Blocks [N, nb, bytes] of format `fmt` (one of OF's), N a multiple of 16, as groups [N / 16, nb, group bytes]."""
    n, nb, nbytes = blocks.shape
    r = np.ascontiguousarray(blocks).reshape(n // ROWS, ROWS, nb, nbytes)
    g = n // ROWS

    def per_row(a: np.ndarray) -> np.ndarray:   # [g, 16, nb, k, width] -> [g, nb, k, 16, width] -> [g, nb, bytes]
        return a.transpose(0, 2, 3, 1, 4).reshape(g, nb, -1)

    def f16s(at: int) -> np.ndarray:            # the rows' f16 at byte `at` of each block: [16 rows][2]
        return per_row(r[..., None, at:at + 2])

    if fmt == "Q6_K":   # low nibbles as Q4_K's, high 2 bits [2 t][8 k][16 rows][4], int8 scales [16][16], d
        q = _q6_k_weights(r).reshape(g, ROWS, nb, 8, 8, 4)                 # [g, 16, nb, sub-block j, k, 4]
        low, high = q & 15, q >> 4
        pairs = low[:, :, :, 0::2] | (low[:, :, :, 1::2] << 4)              # sub-blocks 2p, 2p + 1
        planes = sum(high[:, :, :, u::4] << (2 * u) for u in range(4)).astype(np.uint8)   # sub-blocks 4t + u
        return np.concatenate([per_row(pairs.reshape(g, ROWS, nb, 32, 4)), per_row(planes.reshape(g, ROWS, nb, 16, 4)),
                               per_row(r[..., 192:208, None]), f16s(208)], axis=-1)
    if fmt == "Q4_K":   # nibble bytes [4 p][8 k][16 rows][4], d, dmin, scales and mins [8][16] bytes
        sc, mn = _scales_mins_k4(r[..., 4:16])
        return np.concatenate([per_row(r[..., 16:].reshape(g, ROWS, nb, 32, 4)), f16s(0), f16s(2),
                               per_row(sc[..., None]), per_row(mn[..., None])], axis=-1)
    if fmt == "IQ4_XS":   # index bytes [8 j][4 k][16 rows][4] (each sub-block's as Q4_0's), d, scales - 32 [8][16]
        high = r[..., 2].astype(np.int32) | (r[..., 3].astype(np.int32) << 8)
        ls = np.stack([((r[..., 4 + j // 2] >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4) for j in range(8)], -1)
        return np.concatenate([per_row(r[..., 8:].reshape(g, ROWS, nb, 32, 4)), f16s(0),
                               per_row((ls.astype(np.uint8) - 32)[..., None])], axis=-1)
    if fmt == "IQ4_NL":   # a kept pair of blocks: index bytes [2 j][4 k][16 rows][4] (Q4_0's per block), d [2 j][16]
        pair = r.reshape(g, ROWS, nb, 2, 18)
        return np.concatenate([per_row(pair[..., 2:].reshape(g, ROWS, nb, 8, 4)), f16s(0), f16s(18)], axis=-1)
    if fmt == "Q8_0":   # [8 k][16 rows][4 bytes] of w + 128, then d
        return np.concatenate([per_row((r[..., 2:] ^ 0x80).reshape(g, ROWS, nb, 8, 4)), f16s(0)], axis=-1)
    nibbles = per_row(r[..., -16:].reshape(g, ROWS, nb, 4, 4))          # [4 k][16 rows][4 nibble bytes]
    if fmt in ("Q4_0", "Q4_1"):   # the nibbles, d (and Q4_1's m)
        return np.concatenate([nibbles, f16s(0), *([f16s(2)] if fmt == "Q4_1" else [])], axis=-1)
    if fmt == "Q5_0":   # the nibbles, 8 masks of the fifth bits, then d
        qh = r[..., 2:6]                                                # [g, 16, nb, 4]: weight j's bit at byte j // 8
        bits = np.stack([(qh[..., k // 2] >> (4 * (k % 2))) & 15 for k in range(8)], axis=-1)   # [g, 16, nb, 8 k]
        pairs = bits.reshape(g, ROWS // 2, 2, nb, 8)                     # rows 2t, 2t + 1 share mask byte t
        masks = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).transpose(0, 2, 3, 1).reshape(g, nb, 64)
        return np.concatenate([nibbles, masks, f16s(0)], axis=-1)
    raise ValueError(f"no interleaved layout for {fmt}")


def deinterleave(groups: jax.Array, name: str) -> jax.Array:
    """Groups [..., G, nb, group bytes] of interleaved format `name` as the file's blocks [..., G * 16, nb, bytes]."""
    *lead, g, nb, _ = groups.shape

    def rows(a: jax.Array, k: int, width: int) -> jax.Array:   # [..., G, nb, k * 16 * width] -> [..., G * 16, nb, k * width]
        at = len(lead)
        a = a.reshape(*lead, g, nb, k, ROWS, width)
        a = a.transpose(*range(at), at, at + 3, at + 1, at + 2, at + 4)   # [..., G, 16, nb, k, width]
        return a.reshape(*lead, g * ROWS, nb, k * width)

    base = FORMATS[name][0]
    if base == "Q6_K":   # q back from its nibbles and 2-bit planes, then the file's order (`_q6_k_weights`)
        pairs, planes = rows(groups[..., :2048], 32, 4), rows(groups[..., 2048:3072], 16, 4)   # [..., N, S, 128 / 64]
        outer = pairs.shape[:-1]
        pairs, planes = pairs.reshape(*outer, 4, 32), planes.reshape(*outer, 2, 32)
        low = jnp.stack([pairs & 15, pairs >> 4], axis=-2).reshape(*outer, 8, 32)                   # sub-block 2p + parity
        high = jnp.stack([(planes >> (2 * u)) & 3 for u in range(4)], axis=-2).reshape(*outer, 8, 32)   # 4t + u
        q = (low | (high << 4)).reshape(*outer, 2, 4, 32)                    # [h, k, l]: weight 128h + 32k + l
        ql = jnp.concatenate([q[..., 0, :] & 15 | ((q[..., 2, :] & 15) << 4), q[..., 1, :] & 15 | ((q[..., 3, :] & 15) << 4)], axis=-1)
        qh = sum((q[..., k, :] >> 4) << (2 * k) for k in range(4)).astype(jnp.uint8)
        return jnp.concatenate([ql.reshape(*ql.shape[:-2], 128), qh.reshape(*qh.shape[:-2], 64),
                                rows(groups[..., 3072:3328], 16, 1), rows(groups[..., 3328:3360], 1, 2)], axis=-1)
    if base == "Q4_K":
        sc, mn = rows(groups[..., 2112:2240], 8, 1), rows(groups[..., 2240:2368], 8, 1)
        scales = [sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6), mn[..., 0:4] | ((mn[..., 4:8] >> 4) << 6),
                  (sc[..., 4:8] & 15) | ((mn[..., 4:8] & 15) << 4)]
        return jnp.concatenate([rows(groups[..., 2048:2080], 1, 2), rows(groups[..., 2080:2112], 1, 2), *scales,
                                rows(groups[..., :2048], 32, 4)], axis=-1)
    if base == "IQ4_XS":
        ls = rows(groups[..., 2080:2208], 8, 1) + jnp.uint8(32)                          # [..., N, nb, 8 sub-blocks]
        high = sum((ls[..., j].astype(jnp.uint16) >> 4) << (2 * j) for j in range(8)).astype(jnp.uint16)
        return jnp.concatenate([rows(groups[..., 2048:2080], 1, 2), (high & 255).astype(jnp.uint8)[..., None],
                                (high >> 8).astype(jnp.uint8)[..., None], (ls[..., 0::2] & 15) | ((ls[..., 1::2] & 15) << 4),
                                rows(groups[..., :2048], 32, 4)], axis=-1)
    if base == "IQ4_NL":
        q = rows(groups[..., :512], 8, 4).reshape(*lead, g * ROWS, nb, 2, 16)
        d = jnp.stack([rows(groups[..., 512 + 32 * j:544 + 32 * j], 1, 2) for j in range(2)], axis=-2)
        return jnp.concatenate([d, q], axis=-1).reshape(*lead, g * ROWS, nb, 36)
    if base in ("Q4_0", "Q4_1"):
        scales = [rows(groups[..., 256 + 32 * i:288 + 32 * i], 1, 2) for i in range(1 if base == "Q4_0" else 2)]
        return jnp.concatenate([*scales, rows(groups[..., :256], 4, 4)], axis=-1)
    d = rows(groups[..., -2 * ROWS:], 1, 2)
    if base == "Q8_0":
        return jnp.concatenate([d, rows(groups[..., :512], 8, 4) ^ jnp.uint8(0x80)], axis=-1)
    nibbles = rows(groups[..., :256], 4, 4)
    m = groups[..., 256:320].reshape(*lead, g, nb, 8, ROWS // 2)       # mask k's byte t: rows 2t (low), 2t + 1 (high)
    bits = jnp.stack([m & 15, m >> 4], axis=-1).reshape(*lead, g, nb, 8, ROWS)   # [..., k, row]
    qh = bits[..., 0::2, :] | (bits[..., 1::2, :] << 4)              # [..., G, nb, 4 bytes, 16 rows]
    return jnp.concatenate([d, rows(qh.swapaxes(-1, -2), 1, 4), nibbles], axis=-1)


def rows_of(table: jax.Array, name: str, ids: jax.Array) -> jax.Array:
    """Rows `ids` of an interleaved table as the file's blocks [..., nb, bytes] (each id's group deinterleaved)."""
    groups = deinterleave(table[ids // ROWS][..., None, :, :], name)   # [..., 16, nb, bytes]
    return jnp.take_along_axis(groups, (ids % ROWS)[..., None, None, None], axis=-3)[..., 0, :, :]
