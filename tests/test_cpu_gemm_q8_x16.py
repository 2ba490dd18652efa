"""Q8_0 / Q5_0 / Q4_0 / Q4_1 / Q4_K / Q6_K / IQ4_XS / IQ4_NL matrices interleaved 16 rows at a time for the q8 GEMM's AVX-512 tiles (ggml_x16.py,
kernels_pallas/cpu/gemm_q8_x16.h): the layout holds the file's bytes (back out exactly, rows of a tied table
included), the kernel computes its specified sums bit for bit (a float64 NumPy model of the one fma chain per
output), a row's result does not depend on its neighbours or the thread split, the products stay within the
activations' rounding of the exact ones, and the loader interleaves exactly where it should."""
from __future__ import annotations

import ctypes

import jax.numpy as jnp
import numpy as np
import pytest
from quant_blocks import gguf_py, random_blocks
from support.cpu_gemm import (activations, assert_within_activation_rounding, block_weights, f16, ggml, k_weights,
                              library, q8_kernel, quantise)

from imp_jax.kernels_pallas import Kernels, ggml_blocks, ggml_x16
from imp_jax.kernels_pallas.cpu import gemm as cpu_gemm
from imp_jax.model.layers import embed
from imp_jax.model.weights import Matrix, interleave_for_q8

FORMATS = ["Q8_0", "Q5_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "IQ4_XS", "IQ4_NL"]
needs_x16 = pytest.mark.skipif(not (cpu_gemm.available() and cpu_gemm.interleaves()),
                               reason="the q8 GEMM's AVX-512 path is not on this CPU")


def interleaved(qtype: str, n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the file's blocks [n, k / W, bytes], the same interleaved, gguf-py's dequantisation)."""
    if qtype == "IQ4_NL":   # the file's blocks, kept in pairs (ggml_blocks.iq4_nl_pairs)
        file_blocks = random_blocks(qtype, n, k // 32, seed=seed)
        blocks, dense = ggml_blocks.iq4_nl_pairs(file_blocks), gguf_py(file_blocks, qtype).reshape(n, k)
    elif qtype in ("Q4_K", "Q6_K", "IQ4_XS"):   # gguf-py cannot quantise these: random valid super-blocks
        blocks = random_blocks(qtype, n, k // 256, seed=seed)
        dense = gguf_py(blocks, qtype).reshape(n, k)
    else:
        blocks, dense = ggml(qtype, n, k, seed)
    return blocks, ggml_x16.interleave(blocks, qtype), dense


def chain_model(x: np.ndarray, blocks: np.ndarray, qtype: str) -> np.ndarray:
    """gemm_q8_x16.h's sums: per output, acc = fma(dd_b, isum_b, acc) in block order from 0, float32 (dd_b *
    isum_b is exact in float64, 24 + 20 bits, so each step is one rounding of an exact sum, as an fma's);
    Q4_K: its 32-weight sub-blocks as the blocks (d_w = d * sc), less off = fl(off + fl(dmin * mn * sd_b)); Q4_1:
    plus off = fl(off + fl(m * sd_b)); Q6_K: its 16-weight blocks (w = q - 32), each against its 32-wide
    activation block's d_x; IQ4_XS: its 32-weight sub-blocks (d_w = d * (ls - 32), w the table's values); IQ4_NL:
    the file's blocks (a kept pair's two), w the table's values."""
    q, d, sd = quantise(x)
    if qtype == "Q6_K":   # blocks of 16: [.., 2 nb, 16]; the lane scales of each half (lanes 0-3, 4-7) as d_w
        qw, lanes, _ = k_weights(blocks, qtype)
        q, d = q.reshape(q.shape[0], -1, 16), np.repeat(d, 2, axis=-1)
        qw, dw, offsets = (qw - 32).reshape(qw.shape[0], -1, 16), lanes[..., ::4].reshape(lanes.shape[0], -1), None
    elif qtype in ("Q4_K", "IQ4_XS"):
        qw, lanes, mins = k_weights(blocks, qtype)
        dw, offsets = lanes[..., 0], None if mins is None else -mins   # one scale a sub-block: its 8 lanes' are equal; dmin * mn, subtracted
    elif qtype == "IQ4_NL":
        b = blocks.reshape(blocks.shape[0], -1, 18)
        qw = ggml_blocks.IQ4_NL_VALUES.astype(np.int64)[np.concatenate([b[..., 2:] & 15, b[..., 2:] >> 4], -1)]
        dw, offsets = f16(b[..., 0:2]), None
    else:
        qw, dw, offsets = block_weights(blocks)   # Q4_1's m, added
    isum = np.einsum("mbj,nbj->mnb", q, qw)
    dd = (dw[None] * d[:, None]).astype(np.float32).astype(np.float64)
    acc = np.zeros(isum.shape[:2], np.float32)
    for b in range(isum.shape[-1]):
        acc = (acc.astype(np.float64) + dd[..., b] * isum[..., b]).astype(np.float32)
    if offsets is not None:   # float32: each product and sum rounded once (a negated min: the same magnitudes)
        off = np.zeros_like(acc)
        for b in range(isum.shape[-1]):
            off = off + offsets[None, :, b].astype(np.float32) * sd[:, None, b]
        acc = acc + off
    return acc


def run_x16(x: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """The x16 product on this thread alone, outside XLA."""
    lib = library()
    lib.imp_gemm_q8_x16_run.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    (m, k), n = x.shape, groups.shape[0] * ggml_x16.ROWS
    x, groups = np.ascontiguousarray(x), np.ascontiguousarray(groups)
    y = np.zeros((m, n), np.float32)
    assert lib.imp_gemm_q8_x16_run(groups.shape[-1], x.ctypes.data, m, k, groups.ctypes.data, n, y.ctypes.data) == 0
    return y


@pytest.mark.parametrize("qtype", FORMATS)
def test_the_layout_holds_the_files_bytes(qtype):
    """Interleaved and back: the same bytes; dequantised and gathered as embedding rows: the same floats.
    Same memory: 16 rows' bytes a group (Q4_K: plus its 16 scales and mins as bytes, 4 bytes a row more;
    IQ4_XS: its scales as bytes, 2 more)."""
    blocks, groups, dense = interleaved(qtype, 48, 768, 1)
    per_row = ggml_blocks.FORMATS[qtype] + {"Q4_K": 4, "IQ4_XS": 2}.get(qtype, 0)
    assert groups.shape == (3, blocks.shape[1], 16 * per_row) and groups.nbytes == blocks.nbytes // ggml_blocks.FORMATS[qtype] * per_row
    name = ggml_x16.OF[qtype]
    assert ggml_blocks.format_of(groups) == name and ggml_blocks.matrix_shape(groups) == (48, 768)
    np.testing.assert_array_equal(np.asarray(ggml_x16.deinterleave(jnp.asarray(groups), name)), blocks)
    np.testing.assert_array_equal(np.asarray(ggml_blocks.dequantize(jnp.asarray(groups))), dense)
    ids = jnp.asarray([[0, 17], [47, 5], [31, 16]])
    np.testing.assert_array_equal(np.asarray(embed(jnp.asarray(groups), ids, jnp.float32)), dense[np.asarray(ids)])


@needs_x16
@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("M", [1, 2, 5, 9, 65, 260])
@pytest.mark.parametrize("N,K", [(16, 256), (48, 768), (160, 1536)])
def test_matches_a_numpy_model_of_its_sums_bit_for_bit(qtype, M, N, K):
    """Rounding, exact block sums and the one fma chain per output, as specified; in XLA (the pool's threads)
    and on one thread. Rows 1 / 2-8 / 9 (a tile of 8 plus one; Q4_K's tiles are 4) / past the 256-row items."""
    blocks, groups, _ = interleaved(qtype, N, K, M * 100 + N)
    x = activations(M, K, M)
    want = chain_model(x, blocks, qtype)
    np.testing.assert_array_equal(np.asarray(q8_kernel(x, jnp.asarray(groups))), want)
    np.testing.assert_array_equal(run_x16(x, groups), want)


@needs_x16
def test_the_one_thread_entry_refuses_a_k_that_is_not_whole_blocks():
    """IQ4_XS's groups hold 256 weights a row: K = 288 is one group and a part, which would read past the rows."""
    lib = library()
    lib.imp_gemm_q8_x16_run.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    _, groups, _ = interleaved("IQ4_XS", 16, 256, 1)
    x, y = np.zeros((1, 288), np.float32), np.zeros((1, 16), np.float32)
    assert lib.imp_gemm_q8_x16_run(groups.shape[-1], x.ctypes.data, 1, 288, groups.ctypes.data, 16, y.ctypes.data) == -1
    assert lib.imp_gemm_q8_x16_run(groups.shape[-1], x.ctypes.data, 1, 256, groups.ctypes.data, 16, y.ctypes.data) == 0


@needs_x16
@pytest.mark.parametrize("qtype", FORMATS)
def test_a_rows_result_does_not_depend_on_its_neighbours(qtype):
    blocks, groups, _ = interleaved(qtype, 96, 512, 5)
    x, w = activations(270, 512, 6), jnp.asarray(groups)
    whole = np.asarray(q8_kernel(x, w))
    for lo, hi in ((0, 1), (5, 6), (3, 10), (7, 16), (250, 262)):
        np.testing.assert_array_equal(np.asarray(q8_kernel(x[lo:hi], w)), whole[lo:hi])


@needs_x16
@pytest.mark.parametrize("qtype", FORMATS)
def test_differs_from_the_exact_product_by_at_most_the_activation_rounding(qtype):
    _, groups, dense = interleaved(qtype, 64, 768, 3)
    assert_within_activation_rounding(groups, dense, activations(8, 768, 4))


def test_the_loader_interleaves_for_cpu_q8_on_one_device_only():
    """Q8_0, Q5_0, Q4_0, Q4_1, Q4_K, Q6_K, IQ4_XS and IQ4_NL matrices of 16-row multiples, with the q8 GEMM on the AVX-512
    path and no tensor parallelism; the other formats (Q5_K here), odd row counts and mixture-of-experts stacks
    stay as the file has them."""
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self):
            self.a = Matrix(ggml("Q5_0", 32, 64, 1)[0])
            self.b = Matrix(ggml("Q8_0", 48, 64, 2)[0])
            self.odd = Matrix(ggml("Q8_0", 40, 64, 3)[0])
            self.k = Matrix(ggml("Q4_0", 32, 64, 4)[0])
            self.k1 = Matrix(ggml("Q4_1", 32, 64, 8)[0])
            self.iq = Matrix(random_blocks("IQ4_XS", 16, 1, seed=9))
            self.k5 = Matrix(random_blocks("Q5_K", 16, 1, seed=10))
            self.nl = Matrix(ggml_blocks.iq4_nl_pairs(random_blocks("IQ4_NL", 16, 2, seed=11)))
            self.kq = Matrix(random_blocks("Q4_K", 32, 1, seed=6))
            self.k6 = Matrix(random_blocks("Q6_K", 16, 1, seed=7))
            self.stack = Matrix(np.stack([ggml("Q8_0", 16, 64, 5)[0]] * 2))

    def formats(kernels: Kernels, tp: int) -> dict[str, str | None]:
        model = Model()
        interleave_for_q8(model, kernels, tp)
        names = ("a", "b", "odd", "k", "k1", "kq", "k6", "iq", "k5", "nl", "stack")
        return {name: ggml_blocks.format_of(getattr(model, name)[...]) for name in names}

    as_file = {"a": "Q5_0", "b": "Q8_0", "odd": "Q8_0", "k": "Q4_0", "k1": "Q4_1", "kq": "Q4_K", "k6": "Q6_K", "iq": "IQ4_XS",
               "k5": "Q5_K", "nl": "IQ4_NL", "stack": "Q8_0"}
    assert formats(Kernels(gemm="exact"), 1) == as_file
    assert formats(Kernels(gemm="cpu_q8"), 2) == as_file
    interleaved = {"a": "Q5_0x16", "b": "Q8_0x16", "k": "Q4_0x16", "k1": "Q4_1x16", "kq": "Q4_Kx16", "k6": "Q6_Kx16",
                   "iq": "IQ4_XSx16", "nl": "IQ4_NLx16"}
    want = {**as_file, **interleaved} if cpu_gemm.interleaves() else as_file
    assert formats(Kernels(gemm="cpu_q8"), 1) == want
