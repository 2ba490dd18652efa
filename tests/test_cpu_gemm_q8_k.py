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
    BIAS,
    PATHS,
    activations,
    assert_rows_independent,
    assert_within_activation_rounding,
    k_weights,
    library,
    needs_kernel,
    q8_kernel,
    quantise,
    run_q8,
)
from quant_blocks import gguf_py, random_blocks

from imp_jax.kernels_pallas import ggml_blocks as quant

KQUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"]
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
