"""The CPU GEMM kernel (kernels_pallas/cpu/gemm.cc) against a float64 NumPy product."""
from __future__ import annotations

import platform
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from imp_jax.kernels_pallas import XLA, Kernels, matmul_wt
from imp_jax.kernels_pallas import ggml_blocks as quant
from imp_jax.kernels_pallas.cpu import gemm as cpu_gemm
from imp_jax.kernels_pallas.xla.gemm import matmul_wt_xla

CPU = Kernels(gemm="exact")

X86 = platform.machine().lower() in ("x86_64", "amd64")


def test_kernel_builds_here():
    """On an x86-64 machine with a compiler (this one, CI) the kernel must not fall back silently."""
    if not (X86 and shutil.which("g++")):
        pytest.skip("needs x86-64 and g++")
    assert cpu_gemm.available()


needs_kernel = pytest.mark.skipif(not cpu_gemm.available(), reason="CPU GEMM kernel not built")
kernel = jax.jit(cpu_gemm.matmul_wt_cpu)
with_cpu_kernel = jax.jit(lambda x, w: matmul_wt(x, w, CPU))


@needs_kernel
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 7, 33, 64])
@pytest.mark.parametrize("N,K", [(1, 1), (2, 7), (3, 8), (4, 9), (5, 17), (47, 64), (49, 130), (97, 33)])
def test_matches_numpy(M, N, K):
    """Every tile edge: rows % 4, columns % 3, K % 8, and the 64-row / 48-column work items."""
    rng = np.random.default_rng(M * 1000 + N * 10 + K)
    x, w = rng.standard_normal((M, K), np.float32), rng.standard_normal((N, K), np.float32)
    got = np.asarray(kernel(x, w))
    want = x.astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(K))


@needs_kernel
def test_threaded_sizes_and_leading_axes():
    """Products big enough to use the helper threads, and x with more than one leading axis."""
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((2, 37, 576), np.float32), rng.standard_normal((961, 576), np.float32)
    got = np.asarray(kernel(x, w))
    assert got.shape == (2, 37, 961)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


@needs_kernel
def test_a_rows_result_does_not_depend_on_its_neighbours():
    """Bit-identical rows whatever the batch around them (batch invariance at temperature 0)."""
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((61, 200), np.float32), rng.standard_normal((131, 200), np.float32)
    whole = np.asarray(kernel(x, w))
    for lo, hi in [(0, 1), (5, 6), (3, 10), (17, 61)]:
        np.testing.assert_array_equal(np.asarray(kernel(x[lo:hi], w)), whole[lo:hi])


@needs_kernel
@pytest.mark.parametrize("M", [1, 4, 5, 9, 64, 65, 200])
@pytest.mark.parametrize("N,K", [(1, 1), (5, 17), (49, 130), (97, 576), (7, 1601)])
def test_bf16_weights_give_the_float32_kernels_bits(M, N, K):
    """bf16 weights (read straight into registers for <= 4 rows, widened into a scratch tile for
    more; long K too) give exactly what the float32 kernel gives on their float32 copies, and the
    exact product."""
    rng = np.random.default_rng(M * 1000 + N * 10 + K)
    x = rng.standard_normal((M, K), np.float32)
    wb = jnp.asarray(rng.standard_normal((N, K), np.float32), jnp.bfloat16)
    got = np.asarray(kernel(x, wb))
    np.testing.assert_array_equal(got, np.asarray(kernel(x, wb.astype(jnp.float32))))
    want = x.astype(np.float64) @ np.asarray(wb, np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(K))


@needs_kernel
def test_matmul_wt_runs_bf16_weights_through_the_kernel_at_any_row_count():
    """XLA would copy bf16 weights to float32 on every call, so the kernel takes every row count."""
    rng = np.random.default_rng(4)
    w = jnp.asarray(rng.standard_normal((40, 24), np.float32), jnp.bfloat16)
    for rows in (1, cpu_gemm.MAX_ROWS + 1):
        x = jnp.asarray(rng.standard_normal((rows, 24), np.float32))
        assert cpu_gemm.TARGET_BF16W in with_cpu_kernel.lower(x, w).as_text()
        np.testing.assert_allclose(np.asarray(with_cpu_kernel(x, w)),
                                   np.asarray(x) @ np.asarray(w, np.float32).T, rtol=1e-5, atol=1e-5)


QTYPES = ["Q8_0", "Q4_0", "Q4_1"]


def ggml_blocks(qtype: str, n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A random [n, k] matrix quantised by gguf-py: (blocks uint8 [n, k / 32, bytes], gguf-py's dequantisation)."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    x = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = quantize(x, Q[qtype])
    return raw.reshape(n, k // quant.BLOCK, quant.FORMATS[qtype]), dequantize(raw, Q[qtype]).reshape(n, k)


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_gives_gguf_pys_values(qtype):
    blocks, want = ggml_blocks(qtype, 7, 96, 5)
    assert quant.format_of(blocks) == qtype and quant.matrix_shape(blocks) == (7, 96)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(jnp.asarray(blocks))), want)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(jnp.asarray(blocks[[4, 1]]))), want[[4, 1]])


@needs_kernel
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("M", [1, 4, 5, 70])
@pytest.mark.parametrize("N,K", [(1, 32), (5, 64), (49, 160), (6, 1600)])
def test_ggml_blocks_give_the_float32_kernels_bits(qtype, M, N, K):
    """GGML blocks are widened to the exact values of their dequantised copy, so the product is
    the float32 kernel's on that copy, bit for bit, and the exact product of it."""
    blocks, dense = ggml_blocks(qtype, N, K, M * 100 + N)
    x = np.random.default_rng(M).standard_normal((M, K)).astype(np.float32)
    got = np.asarray(kernel(x, jnp.asarray(blocks)))
    np.testing.assert_array_equal(got, np.asarray(kernel(x, dense)))
    np.testing.assert_allclose(got, x.astype(np.float64) @ dense.astype(np.float64).T,
                               rtol=1e-5, atol=1e-5 * np.sqrt(K) * np.abs(dense).max())


@needs_kernel
def test_matmul_wt_runs_blocks_through_the_kernel_and_xla_dequantises_them():
    blocks, dense = ggml_blocks("Q4_1", 40, 64, 6)
    w = jnp.asarray(blocks)
    for rows in (1, cpu_gemm.MAX_ROWS + 1):
        x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, 64)).astype(np.float32))
        assert cpu_gemm.BLOCK_TARGETS["Q4_1"] in with_cpu_kernel.lower(x, w).as_text()
        want = np.asarray(x) @ dense.T
        np.testing.assert_allclose(np.asarray(with_cpu_kernel(x, w)), want, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(np.asarray(jax.jit(matmul_wt_xla)(x, w)), want, rtol=1e-5, atol=1e-4)


@needs_kernel
def test_matmul_wt_falls_back_to_xla():
    """Too many rows, another dtype: XLA's dot, same numbers."""
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((40, 24), np.float32))
    for x in (jnp.asarray(rng.standard_normal((cpu_gemm.MAX_ROWS + 1, 24), np.float32)),
              jnp.asarray(rng.standard_normal((3, 24), np.float32))):
        text = with_cpu_kernel.lower(x, w).as_text()
        assert (cpu_gemm.TARGET in text) == (x.shape[0] <= cpu_gemm.MAX_ROWS)
        np.testing.assert_allclose(np.asarray(with_cpu_kernel(x, w)), np.asarray(x) @ np.asarray(w).T,
                                   rtol=1e-5, atol=1e-5)
    bf = jnp.ones((3, 24), jnp.bfloat16)
    assert cpu_gemm.TARGET not in with_cpu_kernel.lower(bf, w.astype(jnp.bfloat16)).as_text()


def test_the_xla_backend_never_calls_the_kernel():
    """`--gemm xla` (Kernels.gemm == "xla"): every product is XLA's dot, blocks dequantised first."""
    blocks, dense = ggml_blocks("Q8_0", 8, 32, 2)
    x = jnp.ones((2, 32))
    for w in (x, jnp.asarray(blocks), x.astype(jnp.bfloat16)):
        text = jax.jit(lambda x, w: matmul_wt(x, w, XLA)).lower(x, w).as_text()
        assert not any(t in text for t in (cpu_gemm.TARGET, cpu_gemm.TARGET_BF16W, *cpu_gemm.BLOCK_TARGETS.values()))
    np.testing.assert_allclose(np.asarray(matmul_wt(x, jnp.asarray(blocks), XLA)), np.asarray(x) @ dense.T,
                               rtol=1e-5, atol=1e-4)
