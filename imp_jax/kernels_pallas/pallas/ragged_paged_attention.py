"""Ragged paged attention as a Pallas Mosaic GPU kernel: prefill chunks and decodes in one call.

Hardware: NVIDIA Hopper (sm_90a: H100/H200). The kernel is written for Mosaic GPU: K/V pages move
GMEM->SMEM by TMA (`copy_gmem_to_smem`, mbarrier completion, double-buffered) and both matmuls are
warpgroup MMAs (`wgmma`: M = 64 rows per warpgroup, bf16/f16 operands in swizzled SMEM, f32
accumulators). TMA and wgmma do not exist before Hopper, and Blackwell (sm_100) replaced wgmma
with tcgen05 MMAs, so other GPUs stay on the XLA backend until a tcgen05 variant exists. f32
caches also stay on the XLA backend on GPU (wgmma would run them as tf32, K-major operands only).

Layout of the work: the flat ragged batch is cut, in XLA, into work items of up to `block_q`
query tokens of one sequence; grid = (work items, kv heads[, kv splits]). A work item stacks its
tokens x the G query heads of its kv head as the 64 MMA rows (GQA: K/V are read once per group),
walks its sequence's pages through `block_tables` (never a dense context) in steps of `block_kv`
keys, and keeps an f32 online softmax. Causal, sliding-window and soft-cap masking are per row.
Key limits (`AttentionMetadata.key_limit`, bidirectional image spans) come in as each row's last
key, max(position, limit) (`_reach_rows`, one more small TMA beside the sinks); a work item then
walks to its rows' furthest last key, not only to its last row. Without them the kernel is as before.
Attention sinks (gpt-oss: a logit per query head, of value 0) are the softmax's starting state:
m = sink, l = 1, acc = 0, as if the sink were a key already seen; never soft-capped.
Split-KV (`split_kv.py`): when few (work item, kv head) programs would leave most SMs idle (a
small-batch decode), each item's steps are cut into up to 16 slices, one program each; programs
then write f32 partial outputs and log-sum-exps, merged exactly in XLA; only the first slice of
each item starts from the sinks, so they count once. With one split (the default for
prefill-heavy buckets) the kernel writes the final output itself.
The new K/V are written right before the kernel by `kv_cache.write_kv` (an XLA scatter,
in place when the step donates the caches). On CPU the same kernel runs in JAX's Mosaic GPU
interpreter (`interpret=True`), which is how CI tests it; two interpreter gaps are bridged there
only: it has no transposed wgmma operand (K^T is staged in SMEM) and no register layout casts.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from imp_jax.kernels_pallas.metadata import AttentionMetadata, AttentionShape, key_reach, token_positions
from imp_jax.kernels_pallas.pallas import split_kv
from imp_jax.kernels_pallas.pallas.shapes import MMA_ROWS, block_kv_for, supports

SWIZZLE = 128            # bytes; SMEM tiles are (8, SWIZZLE // itemsize)
# The Mosaic GPU lowering mode, pinned: Lane is jax 0.10's default, the mode this kernel was written in
# (it sets its register layouts itself, `plgpu.layout_cast`) and the one every lowering check covers, so a
# jax whose default differs (Warpgroup, reported for 0.11) still lowers it so. The interpreter ignores it.
LOWERING = plgpu.LoweringSemantics.Lane
_MASKED = -1e30          # finite, so fully masked rows never produce inf - inf


def interpret_params() -> Any:
    """The Mosaic GPU interpreter's params (CPU execution); its import path moved across jax versions."""
    cls = getattr(plgpu, "InterpretGPUParams", None) or getattr(plgpu, "InterpretParams", None)
    if cls is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as cls
    return cls()


def _work_sizes(num_tokens: int, group: int, num_slots: int) -> tuple[int, int]:
    """(block_q, num_work): query tokens per work item (its rows fill one 64-row MMA tile), and the
    static count of work items (every sequence may start a partial one)."""
    block_q = max(1, MMA_ROWS // group)
    return block_q, min(num_tokens, -(-num_tokens // block_q) + min(num_slots, num_tokens))


def auto_kv_splits(q: Any, k_cache: Any, meta: AttentionMetadata, sliding_window: int | None = None,
                   block_kv: int = 64) -> int:
    """The kv splits a call on these shapes gets by default (`split_kv.default_kv_splits`); reads
    only static shapes, so arrays or ShapeDtypeStructs do."""
    T, H, _ = q.shape
    _, _, bs, kvh, _ = k_cache.shape
    block_q, num_work = _work_sizes(T, H // kvh, meta.seq_lens.shape[0])
    bk = block_kv_for(bs, block_kv)
    steps = split_kv.max_kv_steps(meta.block_tables.shape[1] * bs, bk, block_q, sliding_window)
    return split_kv.default_kv_splits(num_work, kvh, steps)


def _plan(meta: AttentionMetadata, num_tokens: int, block_q: int,
          num_work: int) -> tuple[jax.Array, ...]:
    """Cut the ragged batch into work items of <= block_q tokens of one sequence.

    Returns work int32 [W, 3] = (seq, kv position of the first row, rows), each item's first
    flat token, and per token its (work item, row, valid).
    """
    S = meta.seq_lens.shape[0]
    live = jnp.arange(S) < meta.num_seqs
    qsl = meta.query_start_loc
    q_lens = jnp.where(live, qsl[1:] - qsl[:-1], 0)
    tiles = (q_lens + block_q - 1) // block_q
    tile_end = jnp.cumsum(tiles)
    tile_start = tile_end - tiles
    w = jnp.arange(num_work, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(tile_end, w, side="right", method="compare_all"), 0, S - 1).astype(jnp.int32)
    j = w - tile_start[seq]
    rows = jnp.where(w < tile_end[-1], jnp.clip(q_lens[seq] - j * block_q, 0, block_q), 0)
    pos0 = meta.seq_lens[seq] - q_lens[seq] + j * block_q
    tok_seq, _, valid = token_positions(meta, num_tokens)
    offset = jnp.arange(num_tokens, dtype=jnp.int32) - qsl[tok_seq]
    tok_work = jnp.clip(tile_start[tok_seq] + offset // block_q, 0, num_work - 1)
    tok_row = jnp.clip(offset % block_q, 0, block_q - 1)
    work = jnp.stack([seq, pos0, rows], axis=1).astype(jnp.int32)
    return work, qsl[seq] + j * block_q, tok_work, tok_row, valid


def _kv_steps(work: jax.Array, block_kv: int, sliding_window: int | None,
              last_key: jax.Array | None = None) -> jax.Array:
    """Append each work item's [first, end) kv step: keys from the window start to its last row (to
    `last_key` [W], its rows' furthest key, with key limits)."""
    pos0, rows = work[:, 1], work[:, 2]
    lo = jnp.zeros_like(pos0) if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
    last = pos0 + rows - 1 if last_key is None else last_key
    end = jnp.where(rows > 0, (last + block_kv) // block_kv, 0)
    lo = jnp.minimum(lo // block_kv, end)
    return jnp.concatenate([work, lo[:, None], end[:, None]], axis=1)


def _sink_rows(sinks: jax.Array | None, kv_heads: int, group: int, block_q: int, rows_m: int,
               splits: int) -> jax.Array:
    """f32 [KVH, splits, rows_m]: each kernel row's starting softmax max. Row r of kv head h is
    query head h * group + r % group, so it starts at that head's sink in the first kv slice only
    (the sink counts once when slices merge); other slices, padding rows and calls without sinks
    start at -1e30, where the first visible key's rescale exp(-1e30 - m) wipes the initial l = 1."""
    none = jnp.full((kv_heads, splits, rows_m), _MASKED, jnp.float32)
    if sinks is None:
        return none
    rows = jnp.tile(jnp.maximum(sinks.astype(jnp.float32), _MASKED).reshape(kv_heads, group), (1, block_q))
    return none.at[:, 0, :block_q * group].set(rows)


def _reach_rows(meta: AttentionMetadata, num_tokens: int, tok: jax.Array, live: jax.Array, group: int,
                rows_m: int) -> tuple[jax.Array, jax.Array]:
    """Key limits as the kernel reads them: int32 [W, rows_m], each row's last key (`metadata.key_reach`:
    max(position, limit)), row r of an item being its token r // group (padding rows -1: no key); and
    [W] each item's furthest one (where its kv steps end)."""
    seq, pos, _ = token_positions(meta, num_tokens)
    reach = jnp.where(live, key_reach(meta, seq, pos)[tok], -1)                  # [W, block_q]
    rows = jnp.repeat(reach, group, axis=1)
    return jnp.pad(rows, ((0, 0), (0, rows_m - rows.shape[1])), constant_values=-1), reach.max(axis=1)


def _smem(shape: tuple[int, ...], dtype: Any) -> Any:
    """An SMEM buffer tiled and swizzled the way TMA and wgmma want 2D operands."""
    tile = SWIZZLE // jnp.dtype(dtype).itemsize
    if shape[-1] % tile:  # only reachable in interpret mode (`supports` rejects it), where tiling is moot
        return plgpu.SMEM(shape, dtype)
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, tile)),
                                                plgpu.SwizzleTransform(SWIZZLE)))


def _kernel(work_ref: Any, tables_ref: Any, layer_ref: Any, sinks_ref: Any, q_ref: Any, k_ref: Any,
            v_ref: Any, *refs: Any, group: int, block_kv: int, sm_scale: float, sliding_window: int | None,
            soft_cap: float | None, splits: int, key_limits: bool, interpret: bool) -> None:
    """One (work item, kv head[, kv slice]): online-softmax attention of its rows over its
    sequence's pages (its slice of them when splits > 1: then the f32 partial and lse go out).
    The softmax starts from m = the rows' sink logits (`_sink_rows`), l = 1, acc = 0: the sink as
    a key already seen, of value 0; a sink of -1e30 (no sinks, later slices) is no key at all.
    refs: the rows' last keys (`_reach_rows`) with key limits, then the output (and, split, the lse)."""
    reach_ref, (o_ref, *lse) = (refs[0], refs[1:]) if key_limits else (None, refs)
    lse_ref = lse[0] if lse else None
    _, _, bs, _, d = k_ref.shape
    rows_m = q_ref.shape[2]
    pages = block_kv // bs
    max_blocks = tables_ref.shape[1]
    dtype = k_ref.dtype
    w, h = lax.axis_index("work"), lax.axis_index("kv_head")
    seq, pos0, n_rows = work_ref[w, 0], work_ref[w, 1], work_ref[w, 2]
    step_lo, step_end = work_ref[w, 3], work_ref[w, 4]
    split = 0
    if splits > 1:
        split, per = lax.axis_index("kv_split"), work_ref[w, 5]
        step_lo = step_lo + split * per
        step_end = jnp.minimum(step_lo + per, step_end)
    layer = layer_ref[0]
    # register layouts only mean something to the Mosaic GPU compiler; the interpreter has no rule
    lay = (lambda x, _: x) if interpret else plgpu.layout_cast

    def scoped(q_smem: Any, k_smem: Any, v_smem: Any, p_smem: Any, kt_smem: Any, sink_smem: Any,
               reach_smem: Any, q_bar: Any, k_bar: Any, v_bar: Any) -> None:
        plgpu.copy_gmem_to_smem(q_ref.at[w, h], q_smem, q_bar.at[0])
        plgpu.copy_gmem_to_smem(sinks_ref.at[h, split], sink_smem, q_bar.at[0])
        if key_limits:
            plgpu.copy_gmem_to_smem(reach_ref.at[w], reach_smem, q_bar.at[0])

        def fetch(step: jax.Array, slot: jax.Array | int) -> None:
            for p in range(pages):  # one TMA per page; each barrier expects `pages` arrivals
                blk = tables_ref[seq, jnp.minimum(step * pages + p, max_blocks - 1)]
                rows = pl.ds(p * bs, bs)
                plgpu.copy_gmem_to_smem(k_ref.at[layer, blk, :, h, :], k_smem.at[slot, rows], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[layer, blk, :, h, :], v_smem.at[slot, rows], v_bar.at[slot])

        pl.when(step_lo < step_end)(lambda: fetch(step_lo, 0))
        plgpu.barrier_wait(q_bar.at[0])
        row_tok = lax.div(lay(lax.broadcasted_iota(jnp.int32, (rows_m, block_kv), 0), plgpu.Layout.WGMMA),
                          jnp.int32(group))
        col = lay(lax.broadcasted_iota(jnp.int32, (rows_m, block_kv), 1), plgpu.Layout.WGMMA)
        q_pos = pos0 + row_tok
        last_key = q_pos   # each row's last key: its own position, or further by its key limit
        if key_limits:
            last_key = lax.broadcast_in_dim(lay(reach_smem[...], plgpu.Layout.WGMMA.reduce(1)),
                                            (rows_m, block_kv), [0])

        def qk(slot: jax.Array) -> jax.Array:
            def mma(acc_ref: Any) -> jax.Array:
                if interpret:  # the interpreter does not model transposed wgmma operands
                    kt_smem[...] = k_smem[slot].T
                    plgpu.wgmma(acc_ref, q_smem, kt_smem)
                else:
                    plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                return acc_ref[...]
            return pl.run_scoped(mma, plgpu.ACC((rows_m, block_kv), jnp.float32))

        def pv(slot: jax.Array) -> jax.Array:
            def mma(acc_ref: Any) -> jax.Array:
                plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                return acc_ref[...]
            return pl.run_scoped(mma, plgpu.ACC((rows_m, d), jnp.float32))

        def body(i: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            m, l, acc = carry
            step, slot = step_lo + i, lax.rem(i, 2)
            pl.when(step + 1 < step_end)(lambda: fetch(step + 1, 1 - slot))
            plgpu.barrier_wait(k_bar.at[slot])
            s = qk(slot) * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            key = step * block_kv + col
            mask = (key <= last_key) & (row_tok < n_rows)
            if sliding_window is not None:
                mask &= key > q_pos - sliding_window
            s = jnp.where(mask, s, _MASKED)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l = l * alpha + p.sum(axis=1)
            p_smem[...] = p.astype(dtype)
            plgpu.commit_smem()
            plgpu.barrier_wait(v_bar.at[slot])
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv(slot)
            return m_new, l, acc

        m = lay(sink_smem[...], plgpu.Layout.WGMMA.reduce(1))
        l = lay(jnp.full((rows_m,), 1.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = lay(jnp.full((rows_m, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)
        m, l, acc = lax.fori_loop(0, step_end - step_lo, body, (m, l, acc))
        if splits > 1:
            return m, l, acc  # stored by `store_partial`, in SMEM this scope frees
        l = jnp.maximum(l, 1e-30)  # rows that saw no key (padding) keep acc == 0
        q_smem[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(dtype)  # q is spent
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[w, h])
        plgpu.wait_smem_to_gmem(0)
        return None

    def store_partial(m: jax.Array, l: jax.Array, acc: jax.Array, o_smem: Any, lse_smem: Any) -> None:
        """This slice's normalised f32 output and lse = m + log(l), lse broadcast over LSE_COLS
        columns so both are plain 2D WGMMA-layout stores; m = -1e30 marks rows that saw no key."""
        l = jnp.maximum(l, 1e-30)
        o_smem[...] = acc / lax.broadcast_in_dim(l, acc.shape, [0])
        lse_smem[...] = lax.broadcast_in_dim(m + jnp.log(l), lse_smem.shape, [0])
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[w, h, split])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[w, h, split])
        plgpu.wait_smem_to_gmem(0)

    # work items past the batch (padding) and empty slices touch nothing
    @pl.when((n_rows > 0) & (step_lo < step_end) if splits > 1 else n_rows > 0)
    def _() -> None:
        result = pl.run_scoped(
            scoped,
            _smem((rows_m, d), dtype), _smem((2, block_kv, d), dtype), _smem((2, block_kv, d), dtype),
            _smem((rows_m, block_kv), dtype), _smem((d, block_kv), dtype) if interpret else None,
            plgpu.SMEM((rows_m,), jnp.float32), plgpu.SMEM((rows_m,), jnp.int32) if key_limits else None,
            plgpu.Barrier(num_arrivals=3 if key_limits else 2, num_barriers=1),   # q, sinks[, last keys]
            plgpu.Barrier(num_arrivals=pages, num_barriers=2), plgpu.Barrier(num_arrivals=pages, num_barriers=2),
        )
        if splits > 1:
            pl.run_scoped(functools.partial(store_partial, *result), _smem((rows_m, d), jnp.float32),
                          _smem((rows_m, split_kv.LSE_COLS), jnp.float32))


def ragged_paged_attention_pallas(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, meta: AttentionMetadata,
    layer: jax.Array | int, *, sm_scale: float, sliding_window: int | None = None,
    soft_cap: float | None = None, interpret: bool = False, block_kv: int = 64,
    kv_splits: int | None = None, sinks: jax.Array | None = None,
    lowering: plgpu.LoweringSemantics = LOWERING,
) -> jax.Array:
    """Attention of q [T, H, D] over the paged KV of `layer` (caches [L, NB, BS, KVH, D]).

    Same contract as `xla.oracle.ragged_paged_attention_oracle` (sinks [H] included: one more
    logit per head in each softmax's denominator, never soft-capped; `meta.key_limit` too); K/V must
    already be written.
    kv_splits: slices of each work item's keys, one program each (None: `split_kv.default_kv_splits`
    of the static shapes; 1: no split, no combine). lowering: the Mosaic GPU mode (LOWERING; the other
    one only for checks that lower the kernel under it, tests/test_pallas_export.py).
    """
    if not interpret and not supports(AttentionShape.of(q, k_cache)):
        raise ValueError(f"the compiled Pallas kernel does not take q {q.shape} {q.dtype}, "
                         f"caches {k_cache.shape} {k_cache.dtype}; use the xla attention backend")
    T, H, D = q.shape
    _, _, BS, KVH, _ = k_cache.shape
    G = H // KVH
    block_q, num_work = _work_sizes(T, G, meta.seq_lens.shape[0])
    rows_m = MMA_ROWS * math.ceil(block_q * G / MMA_ROWS)
    bk = block_kv_for(BS, block_kv)
    work, first_tok, tok_work, tok_row, valid = _plan(meta, T, block_q, num_work)
    # q rows of each work item: its tokens (token, group head) -> [W, KVH, rows_m, D] below
    tok = jnp.clip(first_tok[:, None] + jnp.arange(block_q)[None, :], 0, T - 1)
    live = jnp.arange(block_q)[None, :] < work[:, 2:3]
    key_limits = meta.key_limit is not None
    reach_rows, last_key = _reach_rows(meta, T, tok, live, G, rows_m) if key_limits else ((), None)
    work = _kv_steps(work, bk, sliding_window, last_key)
    splits = auto_kv_splits(q, k_cache, meta, sliding_window, block_kv) if kv_splits is None else kv_splits
    if splits < 1:
        raise ValueError(f"kv_splits must be >= 1, got {kv_splits}")
    if splits > 1:
        work = split_kv.with_split_size(work, splits)

    qw = jnp.where(live[..., None, None], q[tok], 0).astype(k_cache.dtype)
    qw = qw.reshape(num_work, block_q, KVH, G, D).transpose(0, 2, 1, 3, 4)
    qw = qw.reshape(num_work, KVH, block_q * G, D)
    qw = jnp.pad(qw, ((0, 0), (0, 0), (0, rows_m - block_q * G), (0, 0)))

    kernel = functools.partial(_kernel, group=G, block_kv=bk, sm_scale=sm_scale, sliding_window=sliding_window,
                               soft_cap=soft_cap, splits=splits, key_limits=key_limits, interpret=interpret)
    if splits == 1:
        out_type: Any = jax.ShapeDtypeStruct((num_work, KVH, rows_m, D), k_cache.dtype)
        grid, names = (num_work, KVH), ("work", "kv_head")
    else:
        lead = (num_work, KVH, splits, rows_m)
        out_type = (jax.ShapeDtypeStruct((*lead, D), jnp.float32),
                    jax.ShapeDtypeStruct((*lead, split_kv.LSE_COLS), jnp.float32))
        grid, names = (num_work, KVH, splits), ("work", "kv_head", "kv_split")
    call = plgpu.kernel(kernel, out_type=out_type, grid=grid, grid_names=names,
                        compiler_params=plgpu.CompilerParams(lowering_semantics=lowering),
                        **({"interpret": interpret_params()} if interpret else {}))
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    sink_rows = _sink_rows(sinks, KVH, G, block_q, rows_m, splits)
    out = call(work, meta.block_tables.astype(jnp.int32), layer_arr, sink_rows, qw, k_cache, v_cache,
               *([reach_rows] if key_limits else []))

    rows = block_q * G
    if splits == 1:
        out = out[:, :, :rows].reshape(num_work, KVH, block_q, G, D)
        out = out[tok_work, :, tok_row]                               # [T, KVH, G, D]
    else:
        parts, lse = out
        parts = parts[:, :, :, :rows].reshape(num_work, KVH, splits, block_q, G, D)[tok_work, :, :, tok_row]
        lse = lse[:, :, :, :rows, 0].reshape(num_work, KVH, splits, block_q, G)[tok_work, :, :, tok_row]
        ran = split_kv.live_splits(work, splits)[tok_work][:, None, :, None]    # [T, 1, splits, 1]
        out = split_kv.combine(parts, lse, ran, axis=2)                         # [T, KVH, G, D]
    return jnp.where(valid[:, None, None, None], out, 0).reshape(T, H, D).astype(q.dtype)

