"""The int8-activation CPU GEMM under test (tests/test_cpu_gemm_q8*.py): a NumPy model of its rounding,
the bounds its results must keep, and its paths called directly outside XLA."""
from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from imp_jax.kernels_pallas import Kernels, matmul_wt
from imp_jax.kernels_pallas import ggml_blocks as quant
from imp_jax.kernels_pallas.cpu import build
from imp_jax.kernels_pallas.cpu import gemm as cpu_gemm


needs_kernel = pytest.mark.skipif(not cpu_gemm.available(), reason="CPU GEMM kernel not built")


q8_kernel = jax.jit(lambda x, w: cpu_gemm.matmul_wt_cpu(x, w, int8_activations=True))


# ------------------------------------------------------------------ the arithmetic, in NumPy
def quantise(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [M, K] as the kernel rounds it: int8 q [M, K / 32, 32], float32 d_x and sd = d_x * sum q [M, K / 32]."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32).astype(np.float32)
    amax = np.abs(xb).max(-1)
    with np.errstate(divide="ignore"):
        scale = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * scale[..., None]).astype(np.int64)   # float32 product, round half to even
    d = (amax / np.float32(127)).astype(np.float32)
    return q, d, (d * q.sum(-1).astype(np.float32)).astype(np.float32)


def block_weights(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """GGML blocks [N, K / 32, bytes] as integer weights [N, K / 32, 32], d and m (Q4_1, Q5_1) as float32."""
    def f16(b: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)

    fmt = quant.format_of(blocks)
    if fmt == "Q8_0":
        return blocks[..., 2:].view(np.int8).astype(np.int64), f16(blocks[..., 0:2]), None
    nibbles = np.concatenate([blocks[..., -16:] & 15, blocks[..., -16:] >> 4], axis=-1).astype(np.int64)
    if fmt in ("Q5_0", "Q5_1"):   # bit j of the little-endian uint32 before the nibbles: weight j's 16s
        at = 2 if fmt == "Q5_0" else 4
        high = np.ascontiguousarray(blocks[..., at:at + 4]).view("<u4").astype(np.int64)
        nibbles = nibbles | (((high >> np.arange(32)) & 1) << 4)
    if fmt in ("Q4_0", "Q5_0"):
        return nibbles - (8 if fmt == "Q4_0" else 16), f16(blocks[..., 0:2]), None
    return nibbles, f16(blocks[..., 0:2]), f16(blocks[..., 2:4])


def ggml(qtype: str, n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A random [n, k] matrix quantised by gguf-py: (blocks, gguf-py's dequantisation)."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = quantize(w, Q[qtype])
    return raw.reshape(n, k // quant.BLOCK, quant.FORMATS[qtype]), dequantize(raw, Q[qtype]).reshape(n, k)


BIAS = {"Q3_K": 4, "Q6_K": 32}   # w = q - bias


def f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 scale bytes [..., 12] as 8 6-bit scales and 8 mins (ggml's get_scale_min_k4)."""
    s = s.astype(np.int64)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return sc, mn


def k_weights(blocks: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Super-blocks [N, S, bytes] as the kernel reads them: integers q [N, 8S, 32] (w = q - BIAS; IQ4_XS:
    the table's values), lane scales D = d * sc [N, 8S, 8] (float32, exact) and mins dmin * mn [N, 8S]
    (Q2_K: [N, 16S], one per 16 weights) or None, with w = D * q - mins (the lane's scale for its 4 weights)."""
    n, s = blocks.shape[:2]
    if fmt == "Q2_K":   # 16 bytes of scale | min << 4 (per 16 weights), 64 of 2-bit q, f16 d, f16 dmin
        sc, qs = blocks[..., 0:16].astype(np.int64), blocks[..., 16:80].astype(np.int64)
        q = np.stack([(qs[..., 32 * (j // 4):32 * (j // 4) + 32] >> (2 * (j % 4))) & 3 for j in range(8)], 2)
        D = f16(blocks[..., 80:82])[..., None] * (sc & 15).astype(np.float32)
        mins = f16(blocks[..., 82:84])[..., None] * (sc >> 4).astype(np.float32)
        return q.reshape(n, 8 * s, 32), np.repeat(D.reshape(n, 8 * s, 2), 4, axis=-1), mins.reshape(n, 16 * s)
    if fmt == "IQ4_XS":   # f16 d, uint16 of the scales' high 2 bits, 4 bytes of low nibbles, 128 of indices
        high = np.ascontiguousarray(blocks[..., 2:4]).view("<u2")[..., 0].astype(np.int64)
        sc = np.stack([((blocks[..., 4 + j // 2].astype(np.int64) >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4)
                       for j in range(8)], -1) - 32
        D = f16(blocks[..., 0:2])[..., None] * sc.astype(np.float32)
        idx = blocks[..., 8:].reshape(n, s, 8, 16)
        q = quant.IQ4_NL_VALUES.astype(np.int64)[np.concatenate([idx & 15, idx >> 4], -1)]
        return q.reshape(n, 8 * s, 32), np.repeat(D.reshape(n, 8 * s, 1), 8, axis=-1), None
    if fmt == "Q3_K":   # 32 bytes of high bits, 64 of 2-bit pairs, 12 of 6-bit scales, f16 d
        hm, qs, sb = (blocks[..., a:b].astype(np.int64) for a, b in ((0, 32), (32, 96), (96, 108)))
        q = np.zeros((n, s, 8, 32), np.int64)
        for j in range(8):   # block j: bits 2 (j % 4) of qs[32 (j // 4) ..], bit j of hmask as 4
            q[:, :, j] = ((qs[..., 32 * (j // 4):32 * (j // 4) + 32] >> (2 * (j % 4))) & 3) | (((hm >> j) & 1) << 2)
        sc = np.stack([((sb[..., t] if t < 8 else sb[..., t - 8] >> 4) & 15) | (((sb[..., 8 + t % 4] >> (2 * (t // 4))) & 3) << 4)
                       for t in range(16)], -1) - 32
        D = f16(blocks[..., 108:110])[..., None] * sc.astype(np.float32)
        return q.reshape(n, 8 * s, 32), np.repeat(D.reshape(n, 8 * s, 2), 4, axis=-1), None
    if fmt == "Q6_K":
        ql, qh = blocks[..., :128].astype(np.int64), blocks[..., 128:192].astype(np.int64)
        q = np.zeros((n, s, 256), np.int64)
        for h in range(2):   # per 128 weights: 64 bytes of low nibbles, 32 of 2-bit pairs
            l0, l1, hb = ql[..., 64 * h:64 * h + 32], ql[..., 64 * h + 32:64 * h + 64], qh[..., 32 * h:32 * h + 32]
            for k, low in enumerate([l0 & 15, l1 & 15, l0 >> 4, l1 >> 4]):
                q[..., 128 * h + 32 * k:128 * h + 32 * k + 32] = low | (((hb >> (2 * k)) & 3) << 4)
        sc = blocks[..., 192:208].view(np.int8).astype(np.float32)            # per 16 weights
        D = f16(blocks[..., 208:210])[..., None] * sc                          # [n, s, 16]
        return (q.reshape(n, 8 * s, 32), np.repeat(D.reshape(n, 8 * s, 2), 4, axis=-1), None)
    sc, mn = scale_min_k4(blocks[..., 4:16])
    at = 16 if fmt == "Q4_K" else 48
    qs = blocks[..., at:at + 128].astype(np.int64).reshape(n, s, 4, 32)
    q = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, s, 8, 32)              # sub-blocks 2i, 2i + 1
    if fmt == "Q5_K":
        qh = blocks[..., 16:48].astype(np.int64)
        q |= ((qh[:, :, None, :] >> np.arange(8)[:, None]) & 1) << 4
    D = (f16(blocks[..., 0:2])[..., None] * sc.astype(np.float32)).astype(np.float32)
    mins = (f16(blocks[..., 2:4])[..., None] * mn.astype(np.float32)).astype(np.float32)
    return q.reshape(n, 8 * s, 32), np.repeat(D.reshape(n, 8 * s, 1), 8, axis=-1), mins.reshape(n, 8 * s)


def activations(m: int, k: int, seed: int) -> np.ndarray:
    """Rows of varied scale, with an all-zero block (d_x = 0) and a block with one large value."""
    x = np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)
    x *= np.float32(4.0) ** (np.arange(m)[:, None] % 7 - 3)
    x[:, 32:64] = 0.0
    x[0, min(k - 1, 70)] = 50.0
    return x


def assert_within_activation_rounding(blocks: np.ndarray, dense: np.ndarray, x: np.ndarray) -> None:
    """The q8 kernel's x @ w.T for GGML `blocks` (whose dequantised matrix is `dense`) is off the exact
    product by at most the rounding of x (d_x / 2 per 32-wide block, times the block's sum |w|; the
    weights are exact), and by something (it is not the exact path)."""
    dense = dense.astype(np.float64)
    got = np.asarray(q8_kernel(x, jnp.asarray(blocks))).astype(np.float64)
    exact = x.astype(np.float64) @ dense.T
    _, d, _ = quantise(x)
    bound = (d.astype(np.float64) / 2) @ np.abs(dense).reshape(dense.shape[0], -1, 32).sum(-1).T
    assert np.all(np.abs(got - exact) <= 1.001 * bound + 1e-5 * np.abs(x) @ np.abs(dense).T)
    assert np.abs(got - exact).max() > 1e-4 * np.abs(exact).max()


def assert_rows_independent(blocks: np.ndarray, x: np.ndarray,
                            slices=((0, 1), (5, 6), (3, 10), (63, 65), (64, 70), (250, 260))) -> None:
    """Bit-identical rows of the q8 kernel whatever rows surround them (`slices` of x's rows)."""
    w = jnp.asarray(blocks)
    whole = np.asarray(q8_kernel(x, w))
    for lo, hi in slices:
        np.testing.assert_array_equal(np.asarray(q8_kernel(x[lo:hi], w)), whole[lo:hi])


# ----------------------------------------------------------------------- the kernel itself
def library() -> ctypes.CDLL:
    lib = build.load("gemm_q8")
    lib.imp_gemm_q8_run.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.imp_gemm_q8_quantise.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                         ctypes.c_void_p, ctypes.c_void_p]
    return lib


# The kernel's paths (imp_q8::Isa), each forced by imp_gemm_q8_run.
PATHS = {0: "AVX2 vpmaddubsw", 1: "VNNI vpdpbusd (256-bit)", 2: "AVX-512 (one row and tiles on zmm)"}


def run_q8(x: np.ndarray, blocks: np.ndarray, isa: int) -> np.ndarray:
    """The q8 product on this thread, outside XLA, on path `isa` (PATHS)."""
    (m, k), n = x.shape, blocks.shape[0]
    x, blocks = np.ascontiguousarray(x), np.ascontiguousarray(blocks)
    y = np.zeros((m, n), np.float32)
    assert library().imp_gemm_q8_run(blocks.shape[-1], isa, x.ctypes.data, m, k, blocks.ctypes.data, n,
                                     y.ctypes.data) == 0, f"path {PATHS[isa]} refused"
    return y


# ------------------------------------------------------------------------- the dispatch
CPU_Q8 = Kernels(gemm="cpu_q8")


def lowered(kernels: Kernels, x: jax.Array, w: jax.Array) -> str:
    return jax.jit(lambda x, w: matmul_wt(x, w, kernels)).lower(x, w).as_text()
