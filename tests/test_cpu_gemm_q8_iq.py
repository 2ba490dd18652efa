"""`--gemm cpu_q8` on the 32-weight table formats (kernels_pallas/cpu/gemm_q8_iq.h): IQ4_NL (kept as pairs of
the file's blocks) and MXFP4 (an E8M0 exponent byte over doubled E2M1 values). Against a float64 NumPy model
of gemm_q8.h's arithmetic with q_w = table[index] (per block fl(d_w * d_x) times the exact integer dot),
against the exact product within the activation rounding, row independence, every integer-dot path
giving the same bits, and the dispatch (the q8 custom call, also for an MXFP4 expert stack's matrices)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.cpu_gemm import (
    CPU_Q8,
    PATHS,
    activations,
    assert_rows_independent,
    assert_within_activation_rounding,
    library,
    lowered,
    needs_kernel,
    q8_kernel,
    quantise,
    run_q8,
)
from quant_blocks import gguf_py, random_blocks

from imp_jax.kernels_pallas import matmul_wt
from imp_jax.kernels_pallas import ggml_blocks as quant
from imp_jax.kernels_pallas.cpu import gemm as cpu_gemm

FORMATS = ["IQ4_NL", "MXFP4"]


def blocks_of(fmt: str, n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random valid blocks [n, k / W, bytes] as kept, and gguf-py's dequantisation [n, k]. Every table
    entry appears in both nibbles; MXFP4 exponents are typical ones (2^-10 .. 2^2: no subnormal or
    infinite scale products, where XLA's flushing would differ from the ctypes path)."""
    b = random_blocks(fmt, n, k // quant.BLOCK, seed=seed)   # the file's 32-weight blocks
    if fmt == "MXFP4":
        b[..., 0] = np.random.default_rng(seed).integers(118, 130, b.shape[:-1])
    b[0, 0, -16:] = np.arange(16, dtype=np.uint8) * 17
    dense = gguf_py(b, fmt)
    return (quant.iq4_nl_pairs(b) if fmt == "IQ4_NL" else b), dense


def table_weights(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Kept blocks as the kernel reads them: integer weights [N, K / 32, 32] (the table's values) and
    d_w [N, K / 32] float32 (IQ4_NL: each half of a kept pair; MXFP4: 2^(e - 128))."""
    fmt = quant.format_of(blocks)
    n = blocks.shape[0]
    if fmt == "IQ4_NL":
        b = blocks.reshape(n, -1, quant.IQ4_NL_BYTES)
        d, table = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0].astype(np.float32), quant.IQ4_NL_VALUES
    else:
        b = blocks
        d, table = np.ldexp(np.float32(1), b[..., 0].astype(np.int32) - 128).astype(np.float32), quant.MXFP4_VALUES
    idx = b[..., -16:]
    return table.astype(np.int64)[np.concatenate([idx & 15, idx >> 4], -1)], d


def table_terms(x: np.ndarray, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The terms the kernel sums in float32, in float64 [M, N, K / 32]: fl(d_w * d_x) * the exact integer
    dot; and their magnitudes."""
    q, d, _ = quantise(x)
    qw, dw = table_weights(blocks)
    dd = (dw[None] * d[:, None]).astype(np.float32).astype(np.float64)
    return dd * np.einsum("mbj,nbj->mnb", q, qw), np.abs(dd) * np.einsum("mbj,nbj->mnb", np.abs(q), np.abs(qw))


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_reference_reads_the_blocks_as_gguf_py_does(fmt):
    blocks, dense = blocks_of(fmt, 6, 128, 2)
    q, d = table_weights(blocks)
    np.testing.assert_array_equal((d[..., None].astype(np.float64) * q).reshape(6, 128), dense)


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("M", [1, 2, 5, 65])
@pytest.mark.parametrize("N,K", [(1, 64), (5, 192), (49, 320), (97, 1600)])
def test_matches_a_numpy_model_of_the_same_arithmetic(fmt, M, N, K):
    """Only the float32 sums of the terms differ from the float64 model. M: one row (gemv), partial 4-row
    tiles, past a 64-row item; N: 1, odd tails of the tiles and zmm pairs, 48-row items; K = 1600: 50
    blocks, not a multiple of 8 blocks."""
    blocks, _ = blocks_of(fmt, N, K, M * 100 + N)
    x = activations(M, K, M)
    got = np.asarray(q8_kernel(x, jnp.asarray(blocks)))
    terms, size = table_terms(x, blocks)
    np.testing.assert_array_less(np.abs(got - terms.sum(-1)), 2e-6 * size.sum(-1) + 1e-30)


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
def test_differs_from_the_exact_product_by_at_most_the_activation_rounding(fmt):
    blocks, dense = blocks_of(fmt, 48, 576, 3)
    assert_within_activation_rounding(blocks, dense, activations(8, 576, 4))


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_rows_result_does_not_depend_on_its_neighbours(fmt):
    blocks, _ = blocks_of(fmt, 131, 320, 5)
    assert_rows_independent(blocks, activations(260, 320, 6))


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("N,K,rows", [(50, 1600, (1, 9)), (53, 320, (2, 7, 70)), (19, 64, (258,))])
def test_every_integer_dot_path_gives_the_same_bits(fmt, N, K, rows):
    """The AVX2 sign trick (IQ4) or bias (MXFP4) with vpmaddubsw, vpdpbusd on 256 bits and the AVX-512
    one-row kernel and tiles (indices split and looked up on 512 bits) give the same lanes and float
    operations: each path this CPU has matches the custom call."""
    lib = library()
    blocks, _ = blocks_of(fmt, N, K, 7)
    for m in rows:
        x = activations(m, K, m)
        via_xla = np.asarray(q8_kernel(x, jnp.asarray(blocks)))
        for isa in range(lib.imp_gemm_q8_isa() + 1):
            np.testing.assert_array_equal(run_q8(x, blocks, isa), via_xla, err_msg=PATHS[isa])


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_q8_calls_the_formats_q8_kernel(fmt):
    """`--gemm cpu_q8` reaches these formats' int8 path (no longer the exact widening), also for one
    expert's matrix taken from an expert stack [E, N, K / W, bytes] inside the program (model/architectures/moe.py)."""
    blocks, _ = blocks_of(fmt, 3 * 16, 128, 9)
    stack = jnp.asarray(blocks.reshape(3, 16, *blocks.shape[1:]))
    x = jnp.asarray(activations(4, 128, 1))
    assert cpu_gemm.Q8_TARGETS[fmt] in lowered(CPU_Q8, x, stack[0])
    assert cpu_gemm.BLOCK_TARGETS[fmt] not in lowered(CPU_Q8, x, stack[0])
    pick = jax.jit(lambda x, s, e: matmul_wt(x, jax.lax.dynamic_index_in_dim(s, e, 0, keepdims=False), CPU_Q8))
    np.testing.assert_array_equal(np.asarray(pick(x, stack, 2)), np.asarray(q8_kernel(x, stack[2])))
