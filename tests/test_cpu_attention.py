"""The CPU ragged paged attention kernel (kernels_pallas/cpu/attention.cc) against a float64 NumPy
oracle and the attention oracle."""
from __future__ import annotations

import dataclasses
import platform
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from imp_jax.kernels_pallas import AttentionShape, Kernels, select_kernels
from imp_jax.kernels_pallas.cpu import attention as cpu_attention
from imp_jax.kernels_pallas.kv_cache import BF16_BITS, write_kv
from imp_jax.kernels_pallas.xla.oracle import ragged_paged_attention_oracle
from attention_cases import REFERENCE_CASES, Case, dense_attention, make_batch

X86 = platform.machine().lower() in ("x86_64", "amd64")


def test_kernel_builds_here():
    """On an x86-64 machine with a compiler (this one, CI) the kernel must not fall back silently."""
    if not (X86 and shutil.which("g++")):
        pytest.skip("needs x86-64 and g++")
    assert cpu_attention.available()
    shape = AttentionShape.of(jnp.zeros((1, 9, 64)), jnp.zeros((1, 2, 16, 3, 64)))
    assert select_kernels(jax.local_devices()[0], shape).attention == "cpu"


needs_kernel = pytest.mark.skipif(not cpu_attention.available(), reason="CPU attention kernel not built")

CASES = {name: dataclasses.replace(case, dtype=jnp.float32) for name, case in REFERENCE_CASES.items()}
CASES.update({
    # pages of 8 (a chunk never crosses a page), GQA 4, head_dim 128, a window of one key
    "small_pages": Case(((0, 19), (30, 1), (9, 4)), group=4, head_dim=128, block_size=8, dtype=jnp.float32,
                        num_tokens=32, num_slots=4, kv_heads=2, sliding_window=1),
    # enough work for the thread pool's helpers: 40 decodes over long contexts, 3 kv heads
    "threaded_decodes": Case(tuple((100 + 7 * i, 1) for i in range(40)), group=3, head_dim=64, block_size=16,
                             dtype=jnp.float32, num_tokens=48, num_slots=48, kv_heads=3),
    # pages larger than a chunk, and tails of 1-3 keys
    "big_pages": Case(((0, 67), (129, 2), (3, 1)), group=1, head_dim=64, block_size=64, dtype=jnp.float32,
                      num_tokens=80, num_slots=4, soft_cap=2.0),
})


def run_kernel(case: Case, q, k, v, k_cache, v_cache, meta, layer: int = 1):
    k_cache, v_cache = write_kv(k_cache, v_cache, k, v, meta.slot_mapping, layer)
    out = jax.jit(lambda *a: cpu_attention.ragged_paged_attention_cpu(
        *a, sm_scale=case.head_dim ** -0.5, sliding_window=case.sliding_window, soft_cap=case.soft_cap))(
        q, k_cache, v_cache, meta, jnp.int32(layer))
    return out, k_cache, v_cache


@needs_kernel
@pytest.mark.parametrize("name", list(CASES))
def test_matches_dense_numpy_and_reference(name: str) -> None:
    case = CASES[name]
    q, k, v, k_cache, v_cache, meta = make_batch(case)
    got, k_cache, v_cache = run_kernel(case, q, k, v, k_cache, v_cache, meta)
    assert got.dtype == jnp.float32 and got.shape == q.shape
    want = dense_attention(case, q, k_cache, v_cache, meta, 1)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-5, rtol=2e-5)
    ref = ragged_paged_attention_oracle(q, k_cache, v_cache, meta, 1, sm_scale=case.head_dim ** -0.5,
                                        sliding_window=case.sliding_window, soft_cap=case.soft_cap)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-5, rtol=2e-5)
    real = int(meta.query_start_loc[meta.num_seqs])
    assert not np.asarray(got[real:]).any(), "padding rows must be zero"


@needs_kernel
@pytest.mark.parametrize("bits", [False, True])
@pytest.mark.parametrize("name", ["chunked_prefill", "mixed_window_soft_cap", "small_pages", "threaded_decodes"])
def test_bfloat16_caches_match_the_reference(name: str, bits: bool) -> None:
    """float32 queries over bfloat16 caches (--kv-cache-dtype bfloat16), as bfloat16 or as its bits
    in uint16 (how a CPU engine stores them): kernel and reference read the same bfloat16 values,
    widened exactly, so they agree to float32 rounding."""
    case = CASES[name]
    q, k, v, k_cache, v_cache, meta = make_batch(case)
    k_cache, v_cache = k_cache.astype(jnp.bfloat16), v_cache.astype(jnp.bfloat16)
    if bits:
        k_cache, v_cache = (jax.lax.bitcast_convert_type(c, BF16_BITS) for c in (k_cache, v_cache))
    dtype = k_cache.dtype
    got, k_cache, v_cache = run_kernel(case, q, k, v, k_cache, v_cache, meta)
    assert k_cache.dtype == dtype and got.dtype == jnp.float32
    ref = ragged_paged_attention_oracle(q, k_cache, v_cache, meta, 1, sm_scale=case.head_dim ** -0.5,
                                        sliding_window=case.sliding_window, soft_cap=case.soft_cap)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-5, rtol=2e-5)


@needs_kernel
def test_a_tokens_output_does_not_depend_on_the_batch() -> None:
    """Each sequence alone gives bit-for-bit the rows it gets inside the whole batch."""
    case = CASES["chunked_prefill"]
    q, k, v, k_cache, v_cache, meta = make_batch(case)
    together, k_cache, v_cache = run_kernel(case, q, k, v, k_cache, v_cache, meta)
    qsl, lens, tables = (np.asarray(x) for x in (meta.query_start_loc, meta.seq_lens, meta.block_tables))
    for s in range(int(meta.num_seqs)):
        n = qsl[s + 1] - qsl[s]
        alone = dataclasses.replace(
            meta, query_start_loc=jnp.asarray([0, n], jnp.int32), seq_lens=jnp.asarray(lens[s:s + 1]),
            block_tables=jnp.asarray(tables[s:s + 1]), slot_mapping=meta.slot_mapping[qsl[s]:qsl[s + 1]],
            num_seqs=jnp.int32(1))
        got, _, _ = run_kernel(case, q[qsl[s]:qsl[s + 1]], k[qsl[s]:qsl[s + 1]], v[qsl[s]:qsl[s + 1]],
                               k_cache, v_cache, alone)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(together[qsl[s]:qsl[s + 1]]))


@needs_kernel
def test_no_sequences_gives_zeros() -> None:
    case = CASES["decode_only"]
    q, k, v, k_cache, v_cache, meta = make_batch(case)
    meta = dataclasses.replace(meta, num_seqs=jnp.int32(0), slot_mapping=jnp.full_like(meta.slot_mapping, -1))
    got, _, _ = run_kernel(case, q, k, v, k_cache, v_cache, meta)
    assert not np.asarray(got).any()


def test_takes_float32_queries_over_float32_or_bfloat16_caches_with_head_dim_a_multiple_of_8() -> None:
    shape = lambda q_dtype, cache, d=64: AttentionShape(jnp.dtype(q_dtype), jnp.dtype(cache), 9, 3, d, 16)
    assert cpu_attention.supports(shape(jnp.float32, jnp.float32))
    assert cpu_attention.supports(shape(jnp.float32, jnp.bfloat16))
    assert cpu_attention.supports(shape(jnp.float32, BF16_BITS))
    assert not cpu_attention.supports(shape(jnp.bfloat16, jnp.bfloat16))
    assert not cpu_attention.supports(shape(jnp.float32, jnp.float32, d=36))


@needs_kernel
def test_entry_point_runs_the_kernel_the_engine_chose() -> None:
    """The model's entry point lowers to the custom call for Kernels(attention="cpu") and to XLA for
    the xla backend, with the same result; asking for the kernel where it cannot run is an error."""
    from imp_jax.kernels_pallas import ragged_paged_attention

    case = CASES["mixed_soft_cap"]
    q, k, v, k_cache, v_cache, meta = make_batch(case, seed=1)
    outs = {}
    for name, kernels in {"cpu": Kernels(attention="cpu"), "xla": Kernels()}.items():
        fn = lambda *a: ragged_paged_attention(*a, sm_scale=0.125, soft_cap=case.soft_cap, kernels=kernels)[0]
        text = jax.jit(fn).lower(q, k, v, k_cache, v_cache, meta, 0).as_text()
        assert (cpu_attention.TARGET in text) == (name == "cpu")
        outs[name] = jax.jit(fn)(q, k, v, k_cache, v_cache, meta, 0)
    np.testing.assert_allclose(np.asarray(outs["cpu"]), np.asarray(outs["xla"]), atol=2e-5, rtol=2e-5)
    bf16 = AttentionShape.of(q.astype(jnp.bfloat16), k_cache.astype(jnp.bfloat16))
    device = jax.local_devices()[0]
    assert select_kernels(device, bf16).attention == "xla"
    with pytest.raises(ValueError, match="float32"):
        select_kernels(device, bf16, attention="cpu")
