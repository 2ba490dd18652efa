"""Split-KV for the Pallas attention kernel: how many slices to cut each work item's keys into, and
the exact merge of the slices' partial softmaxes.

A work item's kv steps [lo, end) are cut into `splits` contiguous slices of `per = ceil((end - lo) /
splits)` steps; slice s is [lo + s * per, min(lo + (s + 1) * per, end)), empty when it starts past
`end` (a short context, or the rounding up of `per`). Each (work item, kv head, slice) program
writes its rows' softmax-normalised output and log-sum-exp `lse = m + log(l)` (m the running max, l
the sum of exp(s - m)); `combine` merges the slices with the usual max rescaling:

    out = sum_s exp(lse_s - max lse) * o_s / sum_s exp(lse_s - max lse)

which equals the one-pass softmax. A row that saw no visible key in a slice has m = -1e30 there, so
its weight is exp(-1e30 - max lse) = 0; a slice that never ran is masked by `live`. Attention sinks
join slice 0 only (a live slice whenever the item has rows): there a row's lse includes its sink,
and one that saw no key keeps o = 0 with lse = sink, which is exactly the sink's share.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

NUM_SMS = 132            # H100 SXM / H200 streaming multiprocessors, where the device does not say (num_sms)
MAX_KV_SPLITS = 16       # a cap not yet tuned on a GPU: each slice adds an f32 partial to write and merge
LSE_COLS = 64            # the lse is stored broadcast into a [rows, 64] f32 tile (a plain WGMMA-layout store)


def max_kv_steps(max_keys: int, block_kv: int, block_q: int, sliding_window: int | None) -> int:
    """The most kv steps one work item can walk: its block table's keys, or its window's span
    (window + block_q - 1 keys, one more step for alignment) when that is shorter."""
    steps = math.ceil(max_keys / block_kv)
    if sliding_window is not None:
        steps = min(steps, math.ceil((sliding_window + block_q - 1) / block_kv) + 1)
    return max(1, steps)


@functools.cache
def num_sms() -> int:
    """The streaming multiprocessors of the default device (jax's `core_count` on a GPU: 132 on an H100
    SXM, 114 on an H100 PCIe), else NUM_SMS: the programs one wave runs."""
    device = jax.devices()[0]
    count = getattr(device, "core_count", None) if device.platform == "gpu" else None
    return int(count) if count else NUM_SMS


def default_kv_splits(num_work: int, kv_heads: int, max_steps: int) -> int:
    """Splits so the grid fills about one wave of `num_sms()` programs: SMs // (work items x kv heads),
    capped at MAX_KV_SPLITS and at the kv steps an item can have. On 132 SMs a batch-1 decode with 8 kv
    heads gets 16; any bucket of more than 66 (work item, kv head) programs gets 1, the unsplit path."""
    return max(1, min(MAX_KV_SPLITS, num_sms() // max(1, num_work * kv_heads), max_steps))


def with_split_size(work: jax.Array, splits: int) -> jax.Array:
    """Append `per`, the kv steps of each slice, to work [W, 5] = (seq, pos0, rows, lo, end)."""
    per = (work[:, 4] - work[:, 3] + splits - 1) // splits
    return jnp.concatenate([work, per[:, None]], axis=1)


def live_splits(work: jax.Array, splits: int) -> jax.Array:
    """bool [W, splits]: which (work item, slice) programs ran (rows to serve and a step to walk)."""
    lo, end, per = work[:, 3:4], work[:, 4:5], work[:, 5:6]
    start = lo + jnp.arange(splits, dtype=work.dtype)[None, :] * per
    return (work[:, 2:3] > 0) & (start < end)


def combine(parts: jax.Array, lse: jax.Array, live: jax.Array, axis: int) -> jax.Array:
    """Merge slices along `axis`: parts [..., splits, ..., D] f32 normalised outputs, lse the same
    without D, live broadcastable to lse. Slices that never ran may hold garbage: they are masked."""
    lse = jnp.where(live, lse, -jnp.inf)
    top = lse.max(axis=axis, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)     # rows no slice served (padding): any finite value
    w = jnp.exp(lse - top)                            # 0 where not live
    num = jnp.sum(w[..., None] * jnp.where(live[..., None], parts, 0.0), axis=axis)
    return num / jnp.maximum(w.sum(axis=axis), 1e-30)[..., None]
