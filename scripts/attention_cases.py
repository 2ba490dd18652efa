"""Attention kernel test cases: random ragged batches (Case, make_batch), the cases the kernels are checked
on (KERNEL_CASES; REFERENCE_CASES for the reference backends) with their tolerances, and a float64 NumPy
oracle. Shared by tests/test_pallas_attention.py and its siblings and by scripts/gpu_check_kernel.py."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from imp_jax.kernels_pallas import AttentionMetadata
from imp_jax.runtime.execution.batch import SeqChunk, StepBatch, build_step_batch


# bf16: inputs and output are rounded to 8 mantissa bits and P is fed to the PV matmul in bf16.
TOLERANCE = {jnp.float32: 1e-4, jnp.bfloat16: 3e-2, jnp.float16: 5e-3}


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
    kv_splits: int | None = None  # the Pallas kernel's; None: its default for the shapes


CASES = {
    "decode_only": Case(((0, 1), (16, 1), (299, 1), (63, 1), (44, 1)), group=8, head_dim=64,
                        block_size=16, dtype=jnp.float32, num_tokens=8, num_slots=8),
    "prefill_only": Case(((0, 300), (0, 5), (0, 1)), group=1, head_dim=128, block_size=32,
                         dtype=jnp.bfloat16, num_tokens=320, num_slots=4, kv_splits=1),
    "chunked_prefill": Case(((100, 37), (200, 20), (31, 17)), group=3, head_dim=64, block_size=16,
                            dtype=jnp.float32, num_tokens=80, num_slots=4, kv_heads=2, kv_splits=1),
    "mixed_window": Case(((0, 70), (200, 1), (90, 30), (5, 1), (61, 1)), group=3, head_dim=128,
                         block_size=32, dtype=jnp.bfloat16, num_tokens=112, num_slots=8,
                         sliding_window=40, kv_splits=1),
    "mixed_soft_cap": Case(((0, 23), (150, 1), (33, 9), (0, 1)), group=8, head_dim=64, block_size=32,
                           dtype=jnp.float32, num_tokens=40, num_slots=6, soft_cap=5.0),
    "mixed_window_soft_cap": Case(((47, 40), (3, 1), (280, 1), (0, 13)), group=1, head_dim=64,
                                  block_size=16, dtype=jnp.bfloat16, num_tokens=64, num_slots=4,
                                  sliding_window=25, soft_cap=3.0),
}


SPLIT_CASES = {
    # split-KV in 4 slices: 702 keys = 11 steps of 64 in slices of 3, 3, 3, 2; 261 keys = 5 steps
    # (2, 2, 1, empty); 131 keys = 3 steps (one empty); one- and four-key contexts (three empty)
    "split_long_decode": Case(((701, 1), (260, 1), (3, 1), (0, 1), (130, 1)), group=4, head_dim=64,
                              block_size=16, dtype=jnp.bfloat16, num_tokens=8, num_slots=8, kv_heads=2,
                              soft_cap=10.0, kv_splits=4),
    # 5 slices over a 64-row prefill chunk's 2 window steps (3 slices empty): its last rows see
    # nothing in the first slice, whose partial must weigh nothing for them
    "split_prefill_window": Case(((300, 64), (900, 1), (0, 20), (37, 1)), group=1, head_dim=128,
                                 block_size=16, dtype=jnp.float16, num_tokens=96, num_slots=6, kv_heads=2,
                                 sliding_window=20, kv_splits=5),
}


KERNEL_CASES = {**CASES, **SPLIT_CASES}


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
