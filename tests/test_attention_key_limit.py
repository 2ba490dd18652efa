"""Per-token key limits (`AttentionMetadata.key_limit`: bidirectional image spans, Gemma 3) in every attention
backend (the oracle, XLA with and without dynamic skips, the Pallas kernel in the Mosaic GPU interpreter and
exported for CUDA, the x86-64 C++ kernel) against a float64 NumPy reference, on ragged batches whose query
chunks start mid-sequence over cached KV and hold spans of several lengths."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import TOLERANCE, Case, make_batch

from imp_jax.kernels_pallas import AttentionMetadata
from imp_jax.kernels_pallas.cpu import attention as cpu_attention
from imp_jax.kernels_pallas.kv_cache import write_kv
from imp_jax.kernels_pallas.pallas import ragged_paged_attention as rpa
from imp_jax.kernels_pallas.xla.attention import ragged_paged_attention_xla
from imp_jax.kernels_pallas.xla.oracle import ragged_paged_attention_oracle



@dataclasses.dataclass(frozen=True)
class SpanCase:
    """A ragged batch (`case`) and, per sequence, its bidirectional spans [lo, hi) in KV positions. A chunk
    never ends strictly inside a span (the scheduler's rule); it may start inside one and run to its end."""

    case: Case
    spans: tuple[tuple[tuple[int, int], ...], ...]


def key_limits(sc: SpanCase, num_tokens: int) -> np.ndarray:
    """int32 [T]: hi - 1 for a query token inside one of its sequence's spans, else -1."""
    out = np.full(num_tokens, -1, np.int32)
    t = 0
    for (start, n), spans in zip(sc.case.seqs, sc.spans):
        for lo, hi in spans:
            assert not lo < start + n < hi, "a chunk may not end inside a span"
            for p in range(max(lo, start), min(hi, start + n)):
                out[t + p - start] = hi - 1
        t += n
    return out


def dense_reference(sc: SpanCase, q, k_cache, v_cache, meta, layer: int) -> np.ndarray:
    """float64 NumPy: query at position p sees keys k <= max(p, limit) inside its sequence, and a window
    drops keys with p - k >= window; soft cap on the scores."""
    case = sc.case
    q, kc, vc = (np.asarray(x, np.float64) for x in (q, k_cache, v_cache))
    tables, qsl = np.asarray(meta.block_tables), np.asarray(meta.query_start_loc)
    limits = key_limits(sc, q.shape[0])
    out = np.zeros_like(q)
    group, bs = case.group, case.block_size
    for i, (start, n) in enumerate(case.seqs):
        keys = np.arange(start + n)
        k = np.repeat(kc[layer, tables[i, keys // bs], keys % bs], group, axis=1)   # [N, H, D]
        v = np.repeat(vc[layer, tables[i, keys // bs], keys % bs], group, axis=1)
        for j, t in enumerate(range(qsl[i], qsl[i + 1])):
            p = start + j
            s = np.einsum("hd,nhd->hn", q[t], k) * case.head_dim ** -0.5
            if case.soft_cap is not None:
                s = case.soft_cap * np.tanh(s / case.soft_cap)
            ok = keys <= max(p, limits[t])
            if case.sliding_window is not None:
                ok &= p - keys < case.sliding_window
            s = np.where(ok, s, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            out[t] = np.einsum("hn,nhd->hd", w / w.sum(-1, keepdims=True), v)
    return out


SPAN_CASES = {
    # a fresh prompt over two 64-row tiles, one span across the tile edge; a chunk starting inside a span
    # (its head cached) and ending at another's end; a decode; a short prompt that is one span but a token
    "tiles": SpanCase(Case(((0, 100), (30, 40), (200, 1), (5, 12)), group=2, head_dim=64, block_size=16,
                           dtype=jnp.float32, num_tokens=160, num_slots=6, kv_heads=2),
                      (((10, 40), (50, 90)), ((20, 50), (55, 70)), ((3, 150),), ((6, 17),))),
    # a window shorter than the spans: keys after a token still pass, keys a window behind do not
    "window_soft_cap": SpanCase(Case(((0, 70), (16, 48), (90, 1)), group=3, head_dim=64, block_size=16,
                                     dtype=jnp.float32, num_tokens=128, num_slots=4, sliding_window=9,
                                     soft_cap=4.0),
                                (((1, 33), (40, 41), (45, 70)), ((0, 20), (24, 64)), ())),
    # a span over a cached head of 3 pages and 2 tiles of the chunk, one-token spans, bf16 caches
    "long_span_bf16": SpanCase(Case(((37, 150), (0, 9)), group=1, head_dim=64, block_size=32,
                                    dtype=jnp.bfloat16, num_tokens=176, num_slots=2, soft_cap=30.0),
                               (((2, 160), (170, 171), (171, 187)), ((1, 9),))),
}


def run_backends(sc: SpanCase, backends: dict, seed: int = 0):
    """(dense reference, outputs) for `sc` on `backends` (name -> attention function): outputs["limited"],
    ["causal"] (every limit -1) and ["none"] (key_limit None), each {name: output}."""
    case = sc.case
    q, k, v, k_cache, v_cache, meta = make_batch(case, seed=seed)
    k_cache, v_cache = write_kv(k_cache, v_cache, k, v, meta.slot_mapping, 1)
    kw = dict(sm_scale=case.head_dim ** -0.5, sliding_window=case.sliding_window, soft_cap=case.soft_cap)
    limited = dataclasses.replace(meta, key_limit=jnp.asarray(key_limits(sc, case.num_tokens)))
    causal = dataclasses.replace(meta, key_limit=jnp.full(case.num_tokens, -1, jnp.int32))
    outs = {}
    for label, m in (("limited", limited), ("causal", causal), ("none", meta)):
        outs[label] = {name: np.asarray(jax.jit(lambda *a, f=f: f(*a, **kw))(q, k_cache, v_cache, m, 1), np.float64)
                       for name, f in backends.items()}
    return dense_reference(sc, q, k_cache, v_cache, meta, 1), outs


XLA_BACKENDS = {"oracle": ragged_paged_attention_oracle, "xla": ragged_paged_attention_xla,
                "xla_static": functools.partial(ragged_paged_attention_xla, dynamic_skips=False)}


def check(sc: SpanCase, want: np.ndarray, outs: dict) -> None:
    """Each backend matches the reference with limits; all -1 is bit for bit no limits; the limits matter."""
    tol = TOLERANCE[sc.case.dtype]
    for name, got in outs["limited"].items():
        np.testing.assert_allclose(got, want, atol=tol, rtol=tol, err_msg=name)
        np.testing.assert_array_equal(outs["causal"][name], outs["none"][name], err_msg=name)
        assert np.abs(got - outs["none"][name]).max() > 10 * tol, f"{name}: the key limits changed nothing"


@pytest.mark.parametrize("name", list(SPAN_CASES))
def test_xla_backends_honour_key_limits(name: str) -> None:
    sc = SPAN_CASES[name]
    check(sc, *run_backends(sc, XLA_BACKENDS))


needs_cpu_kernel = pytest.mark.skipif(not cpu_attention.available(), reason="CPU attention kernel not built")


@needs_cpu_kernel
@pytest.mark.parametrize("name", list(SPAN_CASES))
def test_cpu_kernel_honours_key_limits(name: str) -> None:
    sc = SPAN_CASES[name]
    sc = dataclasses.replace(sc, case=dataclasses.replace(sc.case, dtype=jnp.float32))   # it takes f32 queries
    check(sc, *run_backends(sc, {"cpu": cpu_attention.ragged_paged_attention_cpu}))


@pytest.mark.parametrize("name,kv_splits", [("tiles", 1), ("window_soft_cap", 3), ("long_span_bf16", 1)])
def test_pallas_kernel_honours_key_limits(name: str, kv_splits: int) -> None:
    """In the Mosaic GPU interpreter: a work item walks to its rows' furthest key (a span past its last
    row), split or not."""
    sc = SPAN_CASES[name]
    pallas = functools.partial(rpa.ragged_paged_attention_pallas, interpret=True, kv_splits=kv_splits)
    check(sc, *run_backends(sc, {"pallas": pallas}))


def test_pallas_kernel_with_key_limits_and_sinks_matches_xla() -> None:
    """The sinks and the rows' last keys share the kernel's first barrier (three copies); both count."""
    sc = SPAN_CASES["window_soft_cap"]
    q, k, v, k_cache, v_cache, meta = make_batch(sc.case, seed=3)
    k_cache, v_cache = write_kv(k_cache, v_cache, k, v, meta.slot_mapping, 1)
    meta = dataclasses.replace(meta, key_limit=jnp.asarray(key_limits(sc, sc.case.num_tokens)))
    sinks = jnp.linspace(-2.0, 4.0, q.shape[1], dtype=jnp.float32)
    kw = dict(sm_scale=sc.case.head_dim ** -0.5, sliding_window=sc.case.sliding_window, soft_cap=sc.case.soft_cap,
              sinks=sinks)
    want = jax.jit(lambda *a: ragged_paged_attention_xla(*a, **kw))(q, k_cache, v_cache, meta, 1)
    got = jax.jit(lambda *a: rpa.ragged_paged_attention_pallas(*a, **kw, interpret=True, kv_splits=2))(
        q, k_cache, v_cache, meta, 1)
    tol = TOLERANCE[sc.case.dtype]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tol, rtol=tol)


@pytest.mark.parametrize("kv_splits", [1, 2])
def test_pallas_kernel_with_key_limits_lowers_for_cuda(kv_splits: int) -> None:
    """The key-limit rows' TMA, their WGMMA-layout load and mask lower through Mosaic GPU (export for CUDA,
    on this CPU), split and not."""
    from support.kernels import assert_hopper_kernel
    t, s, pages, heads = 16, 4, 8, 8
    i32 = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.int32)   # noqa: E731
    q = jax.ShapeDtypeStruct((t, 2 * heads, 128), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((1, s * pages + 1, 16, heads, 128), jnp.bfloat16)
    meta = AttentionMetadata(i32(s + 1), i32(s), i32(s, pages), i32(t), i32(), key_limit=i32(t))
    fn = functools.partial(rpa.ragged_paged_attention_pallas, sm_scale=0.1, kv_splits=kv_splits, sliding_window=64)
    text = jax.export.export(jax.jit(fn), platforms=("cuda",))(q, cache, cache, meta, i32()).mlir_module()
    assert_hopper_kernel(text, "bfloat16")


def test_images_feature_key_limits_for_a_hand_built_batch() -> None:
    """The images feature's `key_limit` rows: hi - 1 inside a chunk's sequence's atomic spans (a chunk that
    starts inside one, one that ends at one's end, a decode past them), -1 elsewhere and in padding."""
    from imp_jax.runtime.features.images import key_limits as feature_key_limits
    from imp_jax.runtime.request import GenerationRequest, SamplingParams
    from imp_jax.runtime.scheduling.scheduler import ScheduledChunk
    from imp_jax.runtime.scheduling.sequence import Sequence

    def seq(n: int, computed: int, spans: tuple) -> Sequence:
        s = Sequence(request=GenerationRequest("r", list(range(n))), index=0, params=SamplingParams(),
                     max_tokens=4, detok=None, stops=None, prompt_ids=list(range(n)), num_computed=computed)
        s.ext.update({"atomic_spans": spans} if spans else {})
        return s

    chunks = [ScheduledChunk(seq(12, 0, ((2, 5), (7, 10))), 10),      # rows 0-9: positions 0-9
              ScheduledChunk(seq(20, 8, ((4, 12), (15, 16))), 8),     # rows 10-17: positions 8-15
              ScheduledChunk(seq(30, 29, ((3, 20),)), 1),             # row 18: a decode at 29
              ScheduledChunk(seq(9, 0, ()), 3)]                       # rows 19-21: text only
    want = [-1, -1, 4, 4, 4, -1, -1, 9, 9, 9] + [11, 11, 11, 11, -1, -1, -1, 15] + [-1] + [-1] * 3 + [-1] * 2
    np.testing.assert_array_equal(feature_key_limits(chunks, 24), np.asarray(want, np.int32))
