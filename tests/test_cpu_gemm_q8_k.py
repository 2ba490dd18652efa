"""`--gemm cpu_q8` on K-quant super-blocks (kernels_pallas/cpu/gemm_q8_k.h; IQ4_XS, whose integers index a
table, gemm_q8_iq.h): against a float64 NumPy model of the arithmetic its header specifies (per 8-lane
group of 4 weights an exact integer dot scaled by fl(d * sc * d_x), minus the mins' fl(dmin * mn * sd),
Q2_K's per 16-value half), against the exact product within the activation rounding, row independence,
and every integer-dot path giving the same bits."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from support.cpu_gemm import (
    PATHS,
    activations,
    assert_rows_independent,
    assert_within_activation_rounding,
    library,
    needs_kernel,
    q8_kernel,
    quantise,
    run_q8,
)
from quant_blocks import gguf_py, random_blocks

from imp_jax.kernels_pallas import ggml_blocks as quant

KQUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"]
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


def k_terms(x: np.ndarray, blocks: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """The terms the kernel sums in float32, in float64 [M, N, terms]: per block and lane
    fl(D * d_x) * L (L the exact integer dot of the lane's 4 weights, less BIAS), then minus
    fl(mins * sd) (Q2_K: fl(mins * sh), sh = fl(d_x * the sum of each 16 q)); and their magnitudes."""
    q, d, sd = quantise(x)
    m, nb = d.shape
    qw, D, mins = k_weights(blocks, fmt)
    qw = qw - BIAS.get(fmt, 0)
    lanes = np.einsum("mbla,nbla->mnbl", q.reshape(m, nb, 8, 4), qw.reshape(-1, nb, 8, 4))
    size_lanes = np.einsum("mbla,nbla->mnbl", np.abs(q).reshape(m, nb, 8, 4), np.abs(qw).reshape(-1, nb, 8, 4))
    dd = (D[None] * d[:, None, :, None]).astype(np.float32).astype(np.float64)   # [M, N, nb, 8]
    terms, size = (dd * lanes).reshape(m, -1, nb * 8), (np.abs(dd) * size_lanes).reshape(m, -1, nb * 8)
    if mins is not None:
        if mins.shape[-1] == 2 * nb:   # Q2_K: per 16-value half of each activation block
            sd = (d[..., None] * q.reshape(m, nb, 2, 16).sum(-1).astype(np.float32)).astype(np.float32).reshape(m, 2 * nb)
        off = -(mins[None] * sd[:, None]).astype(np.float32).astype(np.float64)
        terms, size = np.concatenate([terms, off], -1), np.concatenate([size, np.abs(off)], -1)
    return terms, size


def k_blocks(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random valid super-blocks [n, k / 256, bytes] (gguf-py cannot quantise K-quants)."""
    return random_blocks(fmt, n, k // quant.WEIGHTS[fmt], seed=seed)


@pytest.mark.parametrize("fmt", KQUANTS)
def test_the_reference_reads_the_blocks_as_gguf_py_does(fmt):
    """The model's integers and scales are the format: D * q - mins is gguf-py's dequantisation."""
    blocks = k_blocks(fmt, 5, 512, 1)
    q, D, mins = k_weights(blocks, fmt)
    w = np.repeat(D, 4, axis=-1).astype(np.float64) * (q - BIAS.get(fmt, 0))
    if mins is not None:
        w -= np.repeat(mins, 32 * q.shape[1] // mins.shape[1], axis=-1).reshape(w.shape)
    np.testing.assert_allclose(w.reshape(5, 512), gguf_py(blocks, fmt), rtol=1e-6, atol=1e-9)


@needs_kernel
@pytest.mark.parametrize("fmt", KQUANTS)
@pytest.mark.parametrize("M,N,K", [(m, n, k) for m in (1, 2, 5, 64, 260) for n, k in ((1, 256), (7, 512), (97, 1536))
                                   if m < 260 or n * k <= 7 * 512])   # 260 rows: the small shapes only
def test_matches_a_numpy_model_of_the_same_arithmetic(fmt, M, N, K):
    """Activation rounding, integer dots and lane scales as the header specifies; only the float32
    sums differ from the float64 model. M: one row (gemv), partial 4-row tiles, a whole 64-row item,
    several items (threaded through XLA); N: 1, an odd tail of the 2-wide tiles, 48-row items."""
    blocks = k_blocks(fmt, N, K, M * 100 + N)
    x = activations(M, K, M)
    got = np.asarray(q8_kernel(x, jnp.asarray(blocks)))
    terms, size = k_terms(x, blocks, fmt)
    np.testing.assert_array_less(np.abs(got - terms.sum(-1)), 2e-6 * size.sum(-1) + 1e-30)


@needs_kernel
@pytest.mark.parametrize("fmt", KQUANTS)
def test_differs_from_the_exact_product_by_at_most_the_activation_rounding(fmt):
    blocks = k_blocks(fmt, 48, 768, 3)
    assert_within_activation_rounding(blocks, gguf_py(blocks, fmt), activations(8, 768, 4))


@needs_kernel
@pytest.mark.parametrize("fmt", KQUANTS)
def test_a_rows_result_does_not_depend_on_its_neighbours(fmt):
    blocks = k_blocks(fmt, 53, 512, 5)
    assert_rows_independent(blocks, activations(70, 512, 6), ((0, 1), (5, 6), (3, 10), (63, 65), (64, 70)))


@needs_kernel
@pytest.mark.parametrize("fmt", KQUANTS)
def test_every_integer_dot_path_gives_the_same_bits(fmt):
    """vpmaddubsw + vpmaddwd and vpdpbusd (the AVX-512 path runs the VNNI kernels for K-quants) give
    the same lanes and the same float operations: the same outputs as the custom call, at one row
    (4-stream passes of 1 to 4 weight rows: N = 50 and 7), tiles and several 64-row items; the AVX-512
    tiles of 8 weight rows whole and in part (N = 12: 8 + 4; 7, 3: an odd row without a pair)."""
    lib = library()
    blocks = k_blocks(fmt, 50, 1024, 7)
    for m, n in ((1, 50), (1, 7), (9, 50), (70, 7), (9, 12), (5, 3)):
        x = activations(m, 1024, m)
        via_xla = np.asarray(q8_kernel(x, jnp.asarray(blocks[:n])))
        for isa in range(lib.imp_gemm_q8_isa() + 1):
            np.testing.assert_array_equal(run_q8(x, blocks[:n], isa), via_xla, err_msg=PATHS[isa])
