"""The Pallas ragged paged attention kernel (Mosaic GPU interpreter on CPU) and the XLA backend against
the attention oracle, the oracle against float64 NumPy, and the choice of backend."""
from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from imp_jax.kernels_pallas import (AttentionMetadata, AttentionShape, Kernels, ragged_paged_attention,
                                    select_kernels)
from imp_jax.kernels_pallas.cpu import attention as cpu_attention
from imp_jax.kernels_pallas.kv_cache import write_kv
from imp_jax.kernels_pallas.pallas.ragged_paged_attention import ragged_paged_attention_pallas, supports
from imp_jax.kernels_pallas.xla.attention import ragged_paged_attention_xla
from imp_jax.kernels_pallas.xla.oracle import ragged_paged_attention_oracle
from imp_jax.runtime.batch import SeqChunk, StepBatch, build_step_batch

sys.path.insert(0, str(Path(__file__).parent))

# bf16: inputs and output are rounded to 8 mantissa bits and P is fed to the PV matmul in bf16.
TOLERANCE = {jnp.float32: 1e-4, jnp.bfloat16: 3e-2}
META_FIELDS = ("query_start_loc", "seq_lens", "block_tables", "slot_mapping", "num_seqs")


@dataclasses.dataclass(frozen=True)
class Case:
    """A random ragged batch: (tokens already cached, new tokens) per sequence, plus kernel knobs."""

    seqs: tuple[tuple[int, int], ...]
    group: int                  # query heads per kv head
    head_dim: int
    block_size: int
    dtype: type
    num_tokens: int             # padded T (>= sum of new tokens: the rest are padding rows)
    num_slots: int              # padded S
    kv_heads: int = 1
    sliding_window: int | None = None
    soft_cap: float | None = None


CASES = {
    "decode_only": Case(((0, 1), (16, 1), (299, 1), (63, 1), (44, 1)), group=8, head_dim=64,
                        block_size=16, dtype=jnp.float32, num_tokens=8, num_slots=8),
    "prefill_only": Case(((0, 300), (0, 5), (0, 1)), group=1, head_dim=128, block_size=32,
                         dtype=jnp.bfloat16, num_tokens=320, num_slots=4),
    "chunked_prefill": Case(((100, 37), (200, 20), (31, 17)), group=3, head_dim=64, block_size=16,
                            dtype=jnp.float32, num_tokens=80, num_slots=4, kv_heads=2),
    "mixed_window": Case(((0, 70), (200, 1), (90, 30), (5, 1), (61, 1)), group=3, head_dim=128,
                         block_size=32, dtype=jnp.bfloat16, num_tokens=112, num_slots=8,
                         sliding_window=40),
    "mixed_soft_cap": Case(((0, 23), (150, 1), (33, 9), (0, 1)), group=8, head_dim=64, block_size=32,
                           dtype=jnp.float32, num_tokens=40, num_slots=6, soft_cap=5.0),
    "mixed_window_soft_cap": Case(((47, 40), (3, 1), (280, 1), (0, 13)), group=1, head_dim=64,
                                  block_size=16, dtype=jnp.bfloat16, num_tokens=64, num_slots=4,
                                  sliding_window=25, soft_cap=3.0),
}


def make_batch(case: Case, seed: int = 0, layers: int = 2) -> tuple[Any, ...]:
    """Random caches with shuffled block tables, new q/k/v, and metadata from build_step_batch."""
    rng = np.random.RandomState(seed)
    bs, kvh, d = case.block_size, case.kv_heads, case.head_dim
    pages = [-(-(start + n) // bs) for start, n in case.seqs]
    max_blocks = max(pages) + 1
    ids = rng.permutation(np.arange(1, sum(pages) + 8))  # block 0 is the null block
    chunks, used = [], 0
    for (start, n), p in zip(case.seqs, pages):
        chunks.append(SeqChunk(rng.randint(0, 100, n).tolist(), start, ids[used:used + p].tolist()))
        used += p
    batch = build_step_batch(chunks, num_tokens=case.num_tokens, num_seqs=case.num_slots,
                             max_blocks=max_blocks, block_size=bs)
    meta = to_meta(batch)
    cache_shape = (layers, len(ids) + 1, bs, kvh, d)
    k_cache = jnp.asarray(rng.randn(*cache_shape), case.dtype)
    v_cache = jnp.asarray(rng.randn(*cache_shape), case.dtype)
    t = case.num_tokens
    q = jnp.asarray(rng.randn(t, kvh * case.group, d), case.dtype)
    k = jnp.asarray(rng.randn(t, kvh, d), case.dtype)
    v = jnp.asarray(rng.randn(t, kvh, d), case.dtype)
    return q, k, v, k_cache, v_cache, meta


def to_meta(batch: StepBatch) -> AttentionMetadata:
    """Device metadata from a host StepBatch."""
    return AttentionMetadata(*(jnp.asarray(getattr(batch, f)) for f in META_FIELDS))


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_the_oracle(name: str) -> None:
    case = CASES[name]
    q, k, v, k_cache, v_cache, meta = make_batch(case)
    kw = dict(sm_scale=case.head_dim ** -0.5, sliding_window=case.sliding_window,
              soft_cap=case.soft_cap)

    @jax.jit  # one program for both: interpret-mode compiles dominate the test time
    def both(q, k, v, k_cache, v_cache, meta, layer):
        k_cache, v_cache = write_kv(k_cache, v_cache, k, v, meta.slot_mapping, layer)
        return (ragged_paged_attention_oracle(q, k_cache, v_cache, meta, layer, **kw),
                ragged_paged_attention_pallas(q, k_cache, v_cache, meta, layer, **kw, interpret=True))

    want, got = both(q, k, v, k_cache, v_cache, meta, jnp.int32(1))
    assert got.dtype == q.dtype and got.shape == q.shape
    tol = TOLERANCE[case.dtype]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=tol, rtol=tol)
    real = int(meta.query_start_loc[meta.num_seqs])
    assert real < case.num_tokens, "every case carries padding rows"
    assert not np.asarray(got[real:], np.float32).any(), "padding rows must be zero"


def dense_attention(case: Case, q, k_cache, v_cache, meta, layer: int) -> np.ndarray:
    """float64 NumPy oracle: each sequence's keys read in order through its block table."""
    q, kc, vc = (np.asarray(x, np.float64) for x in (q, k_cache, v_cache))
    tables, qsl = np.asarray(meta.block_tables), np.asarray(meta.query_start_loc)
    out = np.zeros_like(q)
    group, bs = case.group, case.block_size
    for i, (start, n) in enumerate(case.seqs):
        keys = np.arange(start + n)
        k = kc[layer, tables[i, keys // bs], keys % bs]            # [N, KVH, D]
        v = vc[layer, tables[i, keys // bs], keys % bs]
        for j, t in enumerate(range(qsl[i], qsl[i + 1])):
            p = start + j
            s = np.einsum("hd,nhd->hn", q[t], np.repeat(k, group, axis=1)) * case.head_dim ** -0.5
            if case.soft_cap is not None:
                s = case.soft_cap * np.tanh(s / case.soft_cap)
            ok = keys <= p
            if case.sliding_window is not None:
                ok &= keys > p - case.sliding_window
            s = np.where(ok, s, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            out[t] = np.einsum("hn,nhd->hd", w / w.sum(-1, keepdims=True), np.repeat(v, group, axis=1))
    return out


REFERENCE_CASES = {**CASES,
                   # decode rows after a prefill chunk, past row S: the second prefix walk owns them
                   "decodes_after_prefill": Case(((0, 40), (120, 1), (57, 1), (16, 9)), group=2, head_dim=64,
                                                 block_size=16, dtype=jnp.float32, num_tokens=56,
                                                 num_slots=4, kv_heads=2, sliding_window=70),
                   # T not a multiple of the own-token tile, and whole tiles of padding rows
                   "mostly_padding": Case(((5, 30), (0, 40)), group=3, head_dim=64, block_size=16,
                                          dtype=jnp.float32, num_tokens=200, num_slots=4),
                   # a long chunk after a cached prefix: whole tiles of one sequence share each key block
                   "long_continuation": Case(((300, 150), (40, 1)), group=3, head_dim=64, block_size=16,
                                             dtype=jnp.float32, num_tokens=160, num_slots=4,
                                             sliding_window=200, soft_cap=20.0)}


IMPLEMENTATIONS = {
    "oracle": ragged_paged_attention_oracle,
    "xla": ragged_paged_attention_xla,
    "xla_static": functools.partial(ragged_paged_attention_xla, dynamic_skips=False),   # GPU form
}


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("name", list(REFERENCE_CASES))
def test_xla_attention_and_the_oracle_match_dense_numpy(name: str, impl: str) -> None:
    case = REFERENCE_CASES[name]
    q, k, v, k_cache, v_cache, meta = make_batch(case)
    k_cache, v_cache = write_kv(k_cache, v_cache, k, v, meta.slot_mapping, 1)
    got = jax.jit(lambda *a: IMPLEMENTATIONS[impl](*a, sm_scale=case.head_dim ** -0.5,
                                                   sliding_window=case.sliding_window, soft_cap=case.soft_cap))(
        q, k_cache, v_cache, meta, 1)
    want = dense_attention(case, q, k_cache, v_cache, meta, 1)
    tol = TOLERANCE[case.dtype]
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("group,head_dim,block_size,dtype,window,cap", [
    (1, 128, 16, jnp.bfloat16, None, None), (3, 64, 32, jnp.float16, 40, 5.0),
    (8, 128, 16, jnp.bfloat16, None, 30.0), (128, 64, 64, jnp.bfloat16, 100, None)])
def test_kernel_lowers_to_mosaic_gpu(group: int, head_dim: int, block_size: int, dtype: type,
                                     window: int | None, cap: float | None) -> None:
    """Cross-platform lowering runs the whole Pallas -> Mosaic GPU pipeline (layouts, TMA, wgmma
    shape rules) on CPU; only PTX compilation and the run itself need the GPU."""
    t, s, kvh = 64, 8, 2
    q = jax.ShapeDtypeStruct((t, kvh * group, head_dim), dtype)
    cache = jax.ShapeDtypeStruct((2, 32, block_size, kvh, head_dim), dtype)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    meta = AttentionMetadata(i32(s + 1), i32(s), i32(s, 16), i32(t), i32())
    fn = jax.jit(lambda *a: ragged_paged_attention_pallas(*a, sm_scale=0.1, sliding_window=window,
                                                          soft_cap=cap))
    text = fn.trace(q, cache, cache, meta, i32()).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "wgmma.mma_async" in text


def shape(dtype, head_dim: int = 128, block_size: int = 16, cache=None) -> AttentionShape:
    return AttentionShape(jnp.dtype(dtype), jnp.dtype(cache or dtype), 32, 8, head_dim, block_size)


def test_supports_only_what_the_compiled_kernel_takes() -> None:
    assert supports(shape(jnp.bfloat16))
    assert supports(shape(jnp.float16, head_dim=64, block_size=32))
    assert not supports(shape(jnp.float32))                      # tf32 wgmma: not wired
    assert not supports(shape(jnp.bfloat16, cache=jnp.float32))
    assert not supports(shape(jnp.bfloat16, head_dim=80))
    assert not supports(shape(jnp.bfloat16, block_size=12))      # pages off the 8-row tile


def test_backends_are_chosen_once_and_pallas_needs_a_hopper_gpu() -> None:
    cpu = jax.local_devices()[0]
    auto = select_kernels(cpu, shape(jnp.float32, head_dim=64))
    assert auto.attention in ("cpu", "xla") and auto.dynamic_skips   # a CPU: its kernel where it builds
    assert select_kernels(cpu, shape(jnp.float32), attention="xla", gemm="xla") == Kernels()
    with pytest.raises(ValueError, match="Hopper"):
        select_kernels(cpu, shape(jnp.bfloat16), attention="pallas")
    with pytest.raises(ValueError, match="expected one of"):
        select_kernels(cpu, shape(jnp.float32), attention="bogus")


def test_entry_point_dispatch() -> None:
    """The one entry point writes K/V and runs the backend `kernels` names, with equal results."""
    case = CASES["mixed_soft_cap"]
    q, k, v, k_cache, v_cache, meta = make_batch(case, seed=1)
    outs = {}
    for name, kernels in {"xla": Kernels(), "pallas": Kernels(attention="pallas", pallas_interpret=True)}.items():
        fn = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.125, soft_cap=case.soft_cap, kernels=kernels))
        outs[name] = fn(q, k, v, k_cache, v_cache, meta, 0)
    for want, got in zip(outs["xla"], outs["pallas"]):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)


def test_tiny_model_greedy_tokens_match(tmp_path: Path) -> None:
    from tiny_models import write_tiny_hf

    from imp_jax.model.base import ModelOptions
    from imp_jax.model.config import ModelConfig
    from imp_jax.model.loader import SafetensorsDir, build_from_tensors
    from imp_jax.model.registry import get_model_class
    from imp_jax.model.weights import WeightSource

    write_tiny_hf("LlamaForCausalLM", tmp_path)
    cfg = ModelConfig.from_file(tmp_path / "config.json")
    backends = {"xla": Kernels(), "xla_static": Kernels(dynamic_skips=False),
                "pallas": Kernels(attention="pallas", pallas_interpret=True)}
    if cpu_attention.available():
        backends["cpu"] = Kernels(attention="cpu", gemm="cpu")
    prompt = np.random.RandomState(3).randint(0, cfg.vocab_size, size=11).tolist()
    tokens = {}
    for name, kernels in backends.items():
        model = build_from_tensors(get_model_class(cfg.architecture), cfg, WeightSource(SafetensorsDir(tmp_path)),
                                   ModelOptions(kernels=kernels))
        tokens[name] = greedy(model, prompt)
    assert all(t == tokens["xla"] for t in tokens.values()), tokens


def greedy(model: Any, prompt: list[int], steps: int = 8, block_size: int = 16) -> list[int]:
    """Prefill `prompt` then decode `steps` greedy tokens."""
    @jax.jit
    def step(ids, positions, kv, meta, rows):
        hidden, kv = model(ids, positions, kv, meta)
        return jnp.argmax(model.logits(hidden[rows]), axis=-1), kv

    table = [3, 1, 4]  # deliberately not in order
    kv = tuple(jnp.zeros(model.kv_cache_shape(8, block_size)) for _ in range(2))
    out, chunk = [], SeqChunk(prompt, 0, table)
    for _ in range(steps + 1):
        b = build_step_batch([chunk], num_tokens=16, num_seqs=2, max_blocks=4, block_size=block_size)
        nxt, kv = step(jnp.asarray(b.input_ids), jnp.asarray(b.positions), kv, to_meta(b),
                       jnp.asarray(b.last_token_rows))
        out.append(int(nxt[0]))
        chunk = SeqChunk([out[-1]], chunk.start + len(chunk.token_ids), table)
    return out
