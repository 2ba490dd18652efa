"""The int8-activation GEMM (`--gemm cpu_q8`, auto's pick for GGML blocks; kernels_pallas/cpu/gemm_q8.h): against a float64
NumPy model of the same arithmetic, against the exact product within the bound its rounding allows,
row independence, every integer-dot path (AVX2, VNNI, AVX-512) giving the same bits, the dispatch, and
SmolLM2 end to end."""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.cpu_gemm import (CPU_Q8, PATHS, activations, assert_rows_independent, assert_within_activation_rounding,
                              block_weights, ggml, library, lowered, needs_kernel, q8_kernel, quantise, run_q8)

from imp_jax.kernels_pallas import AttentionShape, Kernels, matmul_wt, select_kernels
from imp_jax.kernels_pallas.cpu import gemm as cpu_gemm
from imp_jax.model.weights import WeightFormats

QTYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]


def q8_terms(x: np.ndarray, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The terms the kernel sums in float32, in float64 [M, N, K / 32 (+ K / 32 for Q4_1)]: per block
    dd * isum, with isum the exact integer dot and dd = d_w * d_x rounded to float32, and m_w * sd;
    and beside them their magnitudes (dd * sum |q_w q_x|: the kernel sums lanes of 4 products)."""
    q, d, sd = quantise(x)
    qw, dw, mw = block_weights(blocks)
    dd = (dw[None] * d[:, None]).astype(np.float32).astype(np.float64)
    terms, size = dd * np.einsum("mbj,nbj->mnb", q, qw), np.abs(dd) * np.einsum("mbj,nbj->mnb", np.abs(q), np.abs(qw))
    if mw is not None:
        offsets = mw[None].astype(np.float64) * sd[:, None].astype(np.float64)
        terms, size = np.concatenate([terms, offsets], axis=-1), np.concatenate([size, np.abs(offsets)], axis=-1)
    return terms, size


@pytest.mark.parametrize("qtype", QTYPES)
def test_the_reference_reads_the_blocks_as_gguf_py_does(qtype):
    blocks, dense = ggml(qtype, 6, 128, 2)
    q, d, m = block_weights(blocks)
    w = d[..., None].astype(np.float64) * q + (0 if m is None else m[..., None])
    np.testing.assert_allclose(w.reshape(6, 128), dense, rtol=1e-6, atol=1e-9)


@needs_kernel
def test_activations_round_half_to_even_per_32_wide_block():
    x = activations(3, 96, 1)
    x[1, :32] = np.arange(32) - 15.5                                   # amax 15.5: scale 127 / 15.5
    x[2, :32] = np.array([127.0, 2.5, -3.5, 0.5, -0.5, 1.5] + [0.0] * 26)   # scale 1: ties stay ties
    q, d, sd = np.zeros((3, 96), np.int8), np.zeros((3, 3), np.float32), np.zeros((3, 3), np.float32)
    library().imp_gemm_q8_quantise(x.ctypes.data, 3, 96, q.ctypes.data, d.ctypes.data, sd.ctypes.data)
    want_q, want_d, want_sd = quantise(x)
    np.testing.assert_array_equal(q.reshape(want_q.shape), want_q)
    np.testing.assert_array_equal(d, want_d)
    np.testing.assert_array_equal(sd, want_sd)
    assert list(q[2, :6]) == [127, 2, -4, 0, 0, 2]
    assert not q[:, 32:64].any() and not d[:, 1].any()


@needs_kernel
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("M", [1, 2, 5, 65])
@pytest.mark.parametrize("N,K", [(1, 32), (5, 96), (49, 288), (97, 1600)])
def test_matches_a_numpy_model_of_the_same_arithmetic(qtype, M, N, K):
    """Activation rounding, integer dots and scales as specified; only the float32 sums of the terms
    differ from the float64 model (K = 1600 is 50 blocks: not a multiple of 8 blocks or of 256; N
    covers the 1-, 2- and 4-wide tiles and the 48-row work items)."""
    blocks, _ = ggml(qtype, N, K, M * 100 + N)
    x = activations(M, K, M)
    got = np.asarray(q8_kernel(x, jnp.asarray(blocks)))
    terms, size = q8_terms(x, blocks)
    np.testing.assert_array_less(np.abs(got - terms.sum(-1)), 2e-6 * size.sum(-1) + 1e-30)


@needs_kernel
@pytest.mark.parametrize("qtype", QTYPES)
def test_differs_from_the_exact_product_by_at_most_the_activation_rounding(qtype):
    """Each x_j is used as d_x * q_j, off by at most d_x / 2, so |y - x @ w.T| <= sum over blocks of
    d_x / 2 * sum |w_j| (the weights are exact); the bound is met, and the error is real (not the
    exact path)."""
    blocks, dense = ggml(qtype, 64, 576, 3)
    assert_within_activation_rounding(blocks, dense, activations(8, 576, 4))


@needs_kernel
@pytest.mark.parametrize("qtype", QTYPES)
def test_a_rows_result_does_not_depend_on_its_neighbours(qtype):
    """Bit-identical rows whatever the rows around them: one row (its own code path), small tiles,
    and across the work items (64 rows; 256 with AVX-512)."""
    blocks, _ = ggml(qtype, 131, 320, 5)
    assert_rows_independent(blocks, activations(260, 320, 6))


@needs_kernel
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("N,K,rows", [(50, 1600, (1, 9)), (53, 320, (2, 7, 70)), (19, 64, (258,))])
def test_every_integer_dot_path_gives_the_same_bits(qtype, N, K, rows):
    """vpmaddubsw + vpmaddwd, vpdpbusd on 256 bits and the AVX-512 tiles (two outputs' lanes a
    register) give the same int32 lanes and the same float operations, so the same outputs; each
    path this CPU has matches the custom call (which picks the best). Rows: one (its own path),
    partial 4-row tiles, past the 256-row work items; N = 53: an odd weight row left without a pair."""
    lib = library()
    assert lib.imp_gemm_q8_isa() >= (1 if lib.imp_gemm_q8_vnni() else 0)
    blocks, _ = ggml(qtype, N, K, 7)
    for m in rows:
        x = activations(m, K, m)
        via_xla = np.asarray(q8_kernel(x, jnp.asarray(blocks)))
        for isa in range(lib.imp_gemm_q8_isa() + 1):
            np.testing.assert_array_equal(run_q8(x, blocks, isa), via_xla, err_msg=PATHS[isa])


@needs_kernel
def test_a_path_this_cpu_lacks_is_refused():
    lib, (blocks, _), x = library(), ggml("Q4_0", 4, 64, 1), activations(2, 64, 1)
    y = np.zeros((2, 4), np.float32)
    for isa in (-1, lib.imp_gemm_q8_isa() + 1):
        assert lib.imp_gemm_q8_run(18, isa, x.ctypes.data, 2, 64, blocks.ctypes.data, 4, y.ctypes.data) == -1
    assert lib.imp_gemm_q8_run(21, 0, x.ctypes.data, 2, 64, blocks.ctypes.data, 4, y.ctypes.data) == -1


@needs_kernel
@pytest.mark.parametrize("qtype", QTYPES)
def test_one_row_on_each_path_is_that_row_inside_a_tile(qtype):
    """The one-row path (4-stream passes of 1 to 4 weight rows, zmm pairs, an odd last row: N = 50
    and 7) gives each row the bits it gets inside a 9-row tile, on every path this CPU has."""
    blocks, _ = ggml(qtype, 50, 1600, 7)
    x = activations(9, 1600, 3)
    for n in (50, 7):
        for isa in range(library().imp_gemm_q8_isa() + 1):
            tiled = run_q8(x, blocks[:n], isa)
            for r in (0, 4):
                np.testing.assert_array_equal(run_q8(x[r:r + 1], blocks[:n], isa), tiled[r:r + 1], err_msg=PATHS[isa])


@needs_kernel
def test_only_cpu_q8_calls_the_q8_kernel_and_only_for_ggml_blocks():
    blocks, _ = ggml("Q4_1", 40, 64, 8)
    x, w = jnp.ones((3, 64)), jnp.asarray(blocks)
    assert cpu_gemm.Q8_TARGETS["Q4_1"] in lowered(CPU_Q8, x, w)
    assert cpu_gemm.BLOCK_TARGETS["Q4_1"] not in lowered(CPU_Q8, x, w)
    for kernels in (Kernels(gemm="exact"), Kernels()):
        assert not any(t in lowered(kernels, x, w) for t in cpu_gemm.Q8_TARGETS.values())
    # float32 and bfloat16 matrices keep the exact kernel (and XLA's dot where it is faster)
    wf = jnp.ones((40, 64))
    assert cpu_gemm.TARGET in lowered(CPU_Q8, x, wf)
    assert cpu_gemm.TARGET_BF16W in lowered(CPU_Q8, x, wf.astype(jnp.bfloat16))
    assert cpu_gemm.TARGET not in lowered(CPU_Q8, jnp.ones((1, 64)), wf)
    np.testing.assert_array_equal(np.asarray(matmul_wt(x, wf, CPU_Q8)), np.full((3, 40), 64.0, np.float32))


@needs_kernel
def test_cpu_q8_is_auto_for_ggml_blocks_only_and_keeps_them():
    """(What auto picks, and why: test_gemm_default.py.)"""
    cpu = jax.local_devices()[0]
    shape = AttentionShape(jnp.dtype(jnp.float32), jnp.dtype(jnp.float32), 9, 3, 64, 16)
    assert select_kernels(cpu, shape).gemm == "exact"
    assert select_kernels(cpu, shape, ggml_blocks=True).gemm == "cpu_q8"
    assert select_kernels(cpu, shape, gemm="cpu_q8").gemm == "cpu_q8"
    assert WeightFormats.for_model(CPU_Q8, jnp.float32).ggml_blocks
    assert not WeightFormats.for_model(CPU_Q8, jnp.bfloat16).ggml_blocks


# -------------------------------------------------------------------- SmolLM2 end to end
@pytest.mark.real_model
@needs_kernel
def test_smollm2_with_cpu_q8_is_batch_invariant_and_answers_like_the_exact_path(smollm2_gguf_path, hf_smollm2):
    """`--gemm cpu_q8`, what the engine builder picks by default for this Q4_1 GGUF: greedy outputs do not depend on the batch (run
    together, the first prompt's decode rows share 16-row steps with the second's prefill; alone they
    run in 1-row steps), and on two confident prompts the first tokens are the exact path's (which
    equal transformers' float32 ones: test_smollm2.py). Not every prompt: on "What is the capital of
    France?" the int8 rounding turns the exact path's first token ("The", then "... Paris.") into
    "L" (docs/PERF.md), as llama.cpp's arithmetic does. The int8 rounding turns any difference in a
    row's bits, however small, into other tokens soon after, so this also holds the rest of the step
    (RMSNorm included) to bitwise row invariance."""
    import torch

    from imp_jax import LLM, SamplingParams

    llm = LLM(str(smollm2_gguf_path), max_num_seqs=2, max_num_batched_tokens=16, max_model_len=128)   # gemm auto
    assert llm.core.loaded.model.options.kernels.gemm == "cpu_q8"
    questions = ["Name three colors of the rainbow.", "What is 2 + 2? Answer with one number and explain it."]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    alone = [llm.generate(q, params, chat=True)[0] for q in questions]
    together = llm.generate(questions, params, chat=True)
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    for out in alone:
        with torch.no_grad():
            prompt = torch.tensor([out.prompt_token_ids])
            exact = hf_smollm2.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids[:4] == exact[0, prompt.shape[1]:].tolist()
    assert llm.core.step_fn.compilations_after_warmup == 0
