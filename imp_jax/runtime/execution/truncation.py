"""Truncation, step 5 of the sampler (sampling.py): top_k, top_p, min_p, typical_p on [R, V] logits.

Removed tokens become -inf; each step sees the distribution the last one left. Cuts are by value,
so tokens tied with the last kept one stay. Rows that need little work get little: top_k up to
FAST_TOP_K (and top_p or typical_p within it) works from lax.top_k candidates; anything wider finds
its cut by bisection over the values' int32 keys (32 passes over the row) instead of sorting it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

if TYPE_CHECKING:
    from imp_jax.runtime.execution.sampling import SamplingTensors

# top_k rows with k <= this are truncated from lax.top_k candidates, not a full sort.
FAST_TOP_K = 64


def switch(dynamic: bool, index: jax.Array, branches: list[Callable[..., Any]], *operands: Any) -> Any:
    """`lax.switch` where data-dependent skips pay (`Kernels.dynamic_skips`, CPUs); else the last
    branch, the general one, which every call site keeps right for every row (no host sync on GPU)."""
    return lax.switch(index, branches, *operands) if dynamic else branches[-1](*operands)


def cond(dynamic: bool, pred: jax.Array, when_true: Callable[..., Any], when_false: Callable[..., Any],
         *operands: Any) -> Any:
    """`lax.cond`, or with `dynamic` off `when_true`, which must be right for every row."""
    return switch(dynamic, pred.astype(jnp.int32), [when_false, when_true], *operands)


def truncate(logits: jax.Array, t: SamplingTensors, dynamic: bool = True) -> jax.Array:
    """top_k, top_p, min_p, typical_p; sorts only when a row needs it, and then as little."""
    vocab = logits.shape[1]
    width = min(FAST_TOP_K, vocab)
    k_on = (t.top_k > 0) & (t.top_k < vocab)
    p_on = t.top_p < 1
    typ_on = t.typical_p < 1
    small_k = k_on & (t.top_k <= width)
    # A row whose survivors all lie in the top `width` can be handled from those alone.
    prefix_branch = _branch(k_on | p_on, small_k)
    typical_branch = _branch(typ_on, small_k)

    # top_k then top_p keep a prefix of the sorted row: one cut value per row.
    cut = switch(
        dynamic, prefix_branch,
        [
            lambda x: jnp.full(x.shape[:1], -jnp.inf, x.dtype),
            lambda x: _prefix_cut(top_values(x, width), t, k_on, p_on),
            lambda x: _threshold_cut(x, t, k_on, p_on, dynamic),
        ],
        logits,
    )
    # min_p compares to the max, which top_k/top_p never remove: it commutes with them.
    logits = cond(
        dynamic, (prefix_branch > 0) | jnp.any(t.min_p > 0),
        lambda x: _cut_and_min_p(x, cut, t.min_p),
        lambda x: x,
        logits,
    )

    return switch(
        dynamic, typical_branch,
        [
            lambda x: x,
            lambda x: _apply_typical(x, top_values(x, width), t.typical_p, typ_on),
            lambda x: _apply_typical_full(x, t.typical_p, typ_on),
        ],
        logits,
    )


def _cut_and_min_p(logits: jax.Array, cut: jax.Array, min_p: jax.Array) -> jax.Array:
    """Remove tokens below the row's cut value or with p < min_p * p_max."""
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    keep = (logits >= cut[:, None]) & (jnp.exp(logits - row_max) >= min_p[:, None])
    return jnp.where(keep, logits, -jnp.inf)


def top_values(x: jax.Array, k: int) -> jax.Array:
    """Each row's k largest values, descending."""
    # The barrier stops XLA fusing TopK's slice into consumers, which on CPU turned the
    # TopK custom call back into a full sort (docs/PERF.md, the sampler section).
    return lax.optimization_barrier(lax.top_k(x, k)[0])


def _branch(on: jax.Array, small_k: jax.Array) -> jax.Array:
    """0 = no row needs this, 1 = every such row is within the top-k candidates, 2 = full."""
    fast = jnp.all(~on | small_k)
    return jnp.where(jnp.any(on), jnp.where(fast, 1, 2), 0)


def _prefix_cut(
    vals: jax.Array, t: SamplingTensors, k_on: jax.Array, p_on: jax.Array
) -> jax.Array:
    """Value of the last token kept by top_k then top_p, from each row sorted descending."""
    width = vals.shape[1]
    pos = jnp.arange(width)[None, :]
    keep = pos < jnp.where(k_on, t.top_k, width)[:, None]
    weights = jnp.where(keep, jnp.exp(vals - vals[:, :1]), 0.0)
    probs = weights / jnp.sum(weights, axis=-1, keepdims=True)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= (mass_before < t.top_p[:, None]) | ~p_on[:, None]
    last = jnp.maximum(jnp.sum(keep, axis=-1), 1) - 1
    cut = jnp.take_along_axis(vals, last[:, None], axis=-1)[:, 0]
    return jnp.where(k_on | p_on, cut, -jnp.inf)


def _threshold_cut(x: jax.Array, t: SamplingTensors, k_on: jax.Array, p_on: jax.Array,
                   dynamic: bool = True) -> jax.Array:
    """`_prefix_cut` of each row sorted, without the sort (a full sort of [R, V] cost several decode
    steps on a CPU, docs/PERF.md): bisection over the values' order-preserving int32 keys finds
    the k-th largest value, then the smallest value whose strictly larger tokens hold less than
    top_p of the top-k mass. Each takes 32 passes over the row, each pass a compare and a sum."""
    keys = _order_key(lax.bitcast_convert_type(x, jnp.int32))    # ordered like x
    lo = jnp.min(keys, axis=-1) - 1
    hi = jnp.max(keys, axis=-1)
    no_cut = jnp.full_like(lo, jnp.iinfo(jnp.int32).min)

    def above(c: jax.Array, values: jax.Array) -> jax.Array:
        return jnp.sum(jnp.where(keys > c[:, None], values, 0), axis=-1)

    # top_k: the smallest key with fewer than k keys above it is the k-th largest.
    k_key = cond(dynamic, jnp.any(k_on),
                 lambda: _bisect(lo, hi, lambda c: above(c, jnp.int32(1)) < t.top_k),
                 lambda: no_cut)
    k_key = jnp.where(k_on, k_key, no_cut)
    # top_p over the top-k survivors: the smallest key whose larger tokens hold < top_p of the mass.
    w = jnp.where(keys >= k_key[:, None], jnp.exp(x - x.max(axis=-1, keepdims=True)), 0.0)
    mass = t.top_p * jnp.sum(w, axis=-1)
    p_key = jnp.where(p_on, _bisect(lo, hi, lambda c: above(c, w) < mass), no_cut)
    key = jnp.minimum(jnp.maximum(k_key, p_key), hi)     # at least the top token survives
    cut = lax.bitcast_convert_type(_order_key(key), jnp.float32)   # the mapping is its own inverse
    return jnp.where(k_on | p_on, cut, -jnp.inf)


def _order_key(bits: jax.Array) -> jax.Array:
    """float32 bits (as int32) -> int32 keys ordered like the floats, -inf lowest; and back."""
    return jnp.where(bits >= 0, bits, bits ^ jnp.int32(0x7FFFFFFF))


def _bisect(lo: jax.Array, hi: jax.Array, pred) -> jax.Array:
    """Per row, the smallest int32 c in (lo, hi] with pred(c), for pred false at lo, true at hi
    and monotone between: 32 halvings cover any int32 range."""
    def body(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)    # floor((lo + hi) / 2) without overflow
        ok = pred(mid)
        return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

    return lax.fori_loop(0, 32, body, (lo, hi))[1]


def _apply_typical(
    logits: jax.Array, vals: jax.Array, typical_p: jax.Array, on: jax.Array
) -> jax.Array:
    """HF TypicalLogitsWarper; `vals` holds every surviving logit of the row (any order)."""
    lse = jax.nn.logsumexp(vals, axis=-1, keepdims=True)
    entropy = _entropy(vals, lse)
    score = jnp.abs(-(vals - lse) - entropy)  # inf for removed tokens
    probs = jnp.exp(vals - lse)
    sorted_score, sorted_probs = lax.sort((score, probs), dimension=-1, num_keys=1)
    below = jnp.sum(jnp.cumsum(sorted_probs, axis=-1) < typical_p[:, None], axis=-1)
    last = jnp.minimum(below, vals.shape[1] - 1)
    cut = jnp.take_along_axis(sorted_score, last[:, None], axis=-1)
    keep = (jnp.abs(-(logits - lse) - entropy) <= cut) | ~on[:, None]
    return jnp.where(keep, logits, -jnp.inf)


def _apply_typical_full(logits: jax.Array, typical_p: jax.Array, on: jax.Array) -> jax.Array:
    """`_apply_typical` over whole rows without sorting them: bisection over the scores' int32 keys
    (scores are >= 0, so their bits are ordered) finds the smallest score whose tokens at or below
    it hold typical_p of the mass, the value the sorted version cuts at."""
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    score = jnp.abs(-(logits - lse) - _entropy(logits, lse))  # inf for removed tokens
    probs = jnp.exp(logits - lse)
    keys = lax.bitcast_convert_type(score, jnp.int32)
    hi = jnp.max(keys, axis=-1)
    key = _bisect(jnp.full_like(hi, -1), hi,
                  lambda c: jnp.sum(jnp.where(keys <= c[:, None], probs, 0.0), axis=-1) >= typical_p)
    cut = lax.bitcast_convert_type(key, jnp.float32)
    return jnp.where((score <= cut[:, None]) | ~on[:, None], logits, -jnp.inf)


def _entropy(vals: jax.Array, lse: jax.Array) -> jax.Array:
    """Entropy in nats of softmax(vals), keepdims; -inf entries contribute nothing."""
    logp = vals - lse
    p = jnp.exp(logp)
    return -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1, keepdims=True)
