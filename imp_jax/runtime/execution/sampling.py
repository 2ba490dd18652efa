"""Token sampler: one jitted program turns logits [R, V] into tokens and logprobs.

Every knob is a per-row array (`SamplingTensors`), so one compiled program serves any
mix of requests. Processing order, each step seeing the output of the one before:

1. penalties over the history window (tokens -1 are padding):
   repetition (HF/CTRL: seen token's logit l -> l / p if l > 0 else l * p, prompt and
   output tokens), then frequency and presence (OpenAI: l -= f * count + p * (count > 0),
   output tokens only); then DRY (dry.py): each row's (token id, penalty) slots, computed on the
   host, subtracted;
2. logit_bias: added to the named ids;
3. allowed mask (structured output): disallowed tokens -> -inf;
4. temperature: rows with temperature > 0 divide by it; greedy rows keep their logits;
5. truncation (truncation.py), removed tokens -> -inf, each step on the distribution left by the last:
   top_k (k <= 0 or k >= V is off), top_p (smallest prefix by probability whose mass
   reaches top_p, at least one token), min_p (drop p < min_p * p_max), typical_p
   (HF TypicalLogitsWarper). Cuts are by value: tokens tied with the last kept one stay;
   mirostat rows (mirostat.py) are truncated by mirostat v1 (a top_k from mu) or v2 (surprise at most
   mu) instead, and the sampler returns their next mu;
6. greedy rows take the argmax; other rows draw by inverse CDF (one uniform per row) with key
   fold_in(key(seed), position) when seeded, else fold_in(step_key, row_index).

Logprobs are log_softmax of the final processed logits (greedy rows: at temperature 1),
so a greedy token is always top_ids[:, 0] and a removed token reads -inf. Every row
needs at least one token that survives the mask, or its outputs are NaN. Beside them, each
id in a row's logit_bias slots gets its raw logprob (log_softmax of the logits before step 1):
a bias of 0 turns a slot into a probe (/v1/score, /v1/decide) without changing the draw.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from imp_jax.runtime.execution import mirostat as miro
from imp_jax.runtime.decoding.dry import DRY_SLOTS
from imp_jax.runtime.request import MIROSTAT_ETA, MIROSTAT_TAU
from imp_jax.runtime.execution.truncation import cond, switch, truncate

# Tokens per block of the two-level inverse-CDF draw.
DRAW_BLOCK = 256


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling knobs for R rows; a pytree, so it passes straight into jit."""

    temperature: jax.Array  # f32[R], <= 0 = greedy
    top_k: jax.Array  # i32[R], <= 0 = off
    top_p: jax.Array  # f32[R], >= 1 = off
    min_p: jax.Array  # f32[R], 0 = off
    typical_p: jax.Array  # f32[R], >= 1 = off
    presence_penalty: jax.Array  # f32[R], 0 = off
    frequency_penalty: jax.Array  # f32[R], 0 = off
    repetition_penalty: jax.Array  # f32[R], 1 = off
    seed: jax.Array  # u32[R]
    has_seed: jax.Array  # bool[R]
    position: jax.Array  # i32[R], index in its sequence of the token being sampled
    history: jax.Array  # i32[R, H], prompt + output token ids, -1 = padding
    history_is_output: jax.Array  # bool[R, H]
    bias_ids: jax.Array  # i32[R, B], -1 = padding
    bias_values: jax.Array  # f32[R, B]
    wants_top_logprobs: jax.Array | None = None  # bool[R]: the row reads its logprobs (the sampled
    #   token's, the top-K); None = every row. Top-K is computed only when some row wants it, and a
    #   batch of greedy rows that all do not skips logprobs altogether; rows that do not may get zeros
    allowed_mask: jax.Array | None = None  # u32[R, ceil(V/32)], bit i%32 of word i//32
    masked: jax.Array | None = None  # bool[R]: the row's allowed_mask restricts it (None: every row)
    dry_ids: jax.Array | None = None  # i32[R, D]: tokens a DRY penalty applies to (dry.py), -1 = padding
    dry_penalties: jax.Array | None = None  # f32[R, D]: subtracted from those tokens' logits
    mirostat: jax.Array | None = None  # i32[R]: 0 = off, 1 or 2 = that version (mirostat.py)
    mirostat_tau: jax.Array | None = None  # f32[R]: target surprise, bits
    mirostat_eta: jax.Array | None = None  # f32[R]: learning rate
    mirostat_mu: jax.Array | None = None  # f32[R]: the sequence's current mu


class SamplerOutput(NamedTuple):
    """Sampled tokens, their processed logprobs, the top-K processed logprobs, the raw logprobs
    of the ids in each row's logit_bias slots, and each mirostat row's next mu."""

    tokens: jax.Array  # i32[R]
    logprob: jax.Array  # f32[R]
    top_ids: jax.Array  # i32[R, K], K = num_top_logprobs, best first
    top_logprobs: jax.Array  # f32[R, K]
    bias_raw_logprobs: jax.Array  # f32[R, B]: raw logprob of bias_ids[r, b]; 0 in padding slots
    mirostat_mu: jax.Array  # f32[R]: mu after this token (mirostat.py); the input mu (or 0) elsewhere


# ---------------------------------------------------------------------------- device


@functools.partial(jax.jit, static_argnames=("num_top_logprobs", "dynamic_skips"))
def sample(
    logits: jax.Array, t: SamplingTensors, step_key: jax.Array, num_top_logprobs: int = 0,
    dynamic_skips: bool = True,
) -> SamplerOutput:
    """Sample one token per row of `logits` (f32[R, V]) under the knobs in `t`. With `dynamic_skips`
    (CPUs, `Kernels.dynamic_skips`) each pass over the vocabulary runs only when some row needs it,
    and a batch of greedy rows that read no logprobs (`wants_top_logprobs` all off) and have no
    typical_p takes the argmax of the penalised, biased, masked logits at once: temperature is 1 for
    greedy rows and top_k, top_p and min_p never remove the largest value (ties stay), so the token
    is the one the full path takes; its logprobs read 0."""
    raw = cond(dynamic_skips, jnp.any(t.bias_ids >= 0), _raw_logprobs_at,
               lambda x, ids: jnp.zeros(ids.shape, jnp.float32), logits, t.bias_ids)
    rows = logits.shape[0]
    k = max(num_top_logprobs, 0)
    penalised = _penalise(logits, t, dynamic_skips)

    def full(x: jax.Array) -> tuple[jax.Array, ...]:
        processed = _scale_and_truncate(x, t, dynamic_skips)
        lse = jax.nn.logsumexp(processed, axis=-1)   # logprobs are processed - lse, never materialised
        greedy_tokens = first_argmax(processed)
        tokens = cond(
            dynamic_skips, jnp.any(t.temperature > 0),
            lambda: jnp.where(
                t.temperature > 0, _draw(processed, t, step_key), greedy_tokens
            ),
            lambda: greedy_tokens,
        )
        logprob = jnp.take_along_axis(processed, tokens[:, None], axis=-1)[:, 0] - lse
        if k == 0:
            return tokens, logprob, jnp.zeros((rows, 0), jnp.float32), jnp.zeros((rows, 0), jnp.int32)

        def top() -> tuple[jax.Array, jax.Array]:
            values, ids = lax.top_k(processed, k)
            return values - lse[:, None], ids.astype(jnp.int32)

        def none_wanted() -> tuple[jax.Array, jax.Array]:
            return jnp.zeros((rows, k), jnp.float32), jnp.zeros((rows, k), jnp.int32)

        wanted = t.wants_top_logprobs
        top_logprobs, top_ids = top() if wanted is None else cond(dynamic_skips, jnp.any(wanted), top, none_wanted)
        return tokens, logprob, top_logprobs, top_ids

    def greedy_only(x: jax.Array) -> tuple[jax.Array, ...]:
        return (first_argmax(x), jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, k), jnp.float32),
                jnp.zeros((rows, k), jnp.int32))

    if t.wants_top_logprobs is None:   # every row reads its logprobs
        tokens, logprob, top_logprobs, top_ids = full(penalised)
    else:
        fast = jnp.all(t.temperature <= 0) & jnp.all(t.typical_p >= 1) & ~jnp.any(t.wants_top_logprobs)
        tokens, logprob, top_logprobs, top_ids = cond(dynamic_skips, ~fast, full, greedy_only, penalised)
    # greedy rows' mu ignores logprob (their surprise is 0), so the greedy-only path's zeros are fine
    mu = jnp.zeros((rows,), jnp.float32) if t.mirostat is None else miro.next_mu(t, logprob)
    return SamplerOutput(tokens, logprob, top_ids.astype(jnp.int32), top_logprobs, raw, mu)


def first_argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` as int32 (the first maximum; the first NaN where a row has one) in
    two plain reductions: XLA's CPU backend runs argmax's (value, index) reduce as a scalar loop,
    ~0.3 ms over a 49k vocabulary, about twice a max and a min."""
    top = jnp.max(x, axis=-1, keepdims=True)
    hit = (x == top) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]), axis=-1)


def _raw_logprobs_at(logits: jax.Array, ids: jax.Array) -> jax.Array:
    """log_softmax of the unprocessed logits [R, V] at `ids` [R, B]; padding ids (-1) read 0."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    picked = jnp.take_along_axis(logits, jnp.maximum(ids, 0), axis=-1) - lse
    return jnp.where(ids >= 0, picked, 0.0)


def _penalise(logits: jax.Array, t: SamplingTensors, dynamic_skips: bool) -> jax.Array:
    """Steps 1-3: penalties, logit_bias, the allowed-token mask."""
    logits = logits.astype(jnp.float32)
    # 0: no penalty; 1: repetition alone (the default preset's, even at temperature 0), on the
    # history's ids only; 2: frequency or presence too, over the whole vocabulary
    counted = jnp.any((t.presence_penalty != 0) | (t.frequency_penalty != 0))
    which = jnp.where(counted, 2, jnp.where(jnp.any(t.repetition_penalty != 1), 1, 0))
    logits = switch(dynamic_skips, which, [lambda x, _: x, _apply_repetition, _apply_penalties], logits, t)
    if t.dry_ids is not None:
        logits = cond(dynamic_skips, jnp.any(t.dry_ids >= 0), _apply_bias, lambda x, *_: x,
                      logits, t.dry_ids, -t.dry_penalties)
    # Each step over the whole [R, V] array runs only when some row of the batch needs it.
    logits = cond(dynamic_skips, jnp.any(t.bias_ids >= 0), _apply_bias, lambda x, *_: x,
                  logits, t.bias_ids, t.bias_values)
    if t.allowed_mask is not None:
        apply = lambda x: jnp.where(_unpack_mask(t.allowed_mask, x.shape[1]), x, -jnp.inf)
        logits = apply(logits) if t.masked is None else cond(
            dynamic_skips, jnp.any(t.masked), apply, lambda x: x, logits)
    return logits


def _scale_and_truncate(logits: jax.Array, t: SamplingTensors, dynamic_skips: bool) -> jax.Array:
    """Steps 4-5: temperature, then top_k, top_p, min_p, typical_p, or mirostat (mirostat.py)."""
    scale = jnp.where(t.temperature > 0, t.temperature, 1.0)
    logits = cond(dynamic_skips, jnp.any(scale != 1), lambda x: x / scale[:, None], lambda x: x, logits)
    if t.mirostat is None:
        return truncate(logits, t, dynamic_skips)
    # v1 is a top_k whose k comes from mu (a mirostat row's own top_k & co. are neutral: RowSpec)
    top_k = cond(dynamic_skips, jnp.any(t.mirostat == 1), miro.v1_top_k, lambda x, t: t.top_k, logits, t)
    logits = truncate(logits, dataclasses.replace(t, top_k=top_k), dynamic_skips)
    return cond(dynamic_skips, jnp.any(t.mirostat == 2), miro.v2_truncate, lambda x, t: x, logits, t)


def _apply_repetition(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """The repetition penalty alone (every row's frequency and presence penalties 0): only the ids
    in a row's history change, so their new values are computed on those [R, H] alone and written
    back (a repeated id writes the same value twice), never as [R, V] arrays; the very bits of
    `_apply_penalties` with those penalties 0 (tests/test_sampling.py)."""
    rows, vocab = logits.shape
    ids = jnp.where(t.history >= 0, t.history, vocab)  # out of range = dropped
    old = jnp.take_along_axis(logits, jnp.minimum(ids, vocab - 1), axis=-1)
    rep = t.repetition_penalty[:, None]
    new = jnp.where(old > 0, old / rep, old * rep)
    return logits.at[jnp.arange(rows)[:, None], ids].set(new, mode="drop")


def _apply_penalties(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """Repetition over the whole history window, then frequency/presence over outputs."""
    rows, vocab = logits.shape
    row_idx = jnp.arange(rows)[:, None]
    ids = jnp.where(t.history >= 0, t.history, vocab)  # out of range = dropped
    counts = jnp.zeros((rows, vocab), jnp.float32)
    counts = counts.at[row_idx, ids].add(t.history_is_output.astype(jnp.float32), mode="drop")
    seen = jnp.zeros((rows, vocab), bool).at[row_idx, ids].set(True, mode="drop")
    rep = t.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - t.frequency_penalty[:, None] * counts
    return logits - t.presence_penalty[:, None] * (counts > 0).astype(jnp.float32)


def _apply_bias(logits: jax.Array, ids: jax.Array, values: jax.Array) -> jax.Array:
    """Add logit_bias values at their ids; padding ids (-1) write nowhere."""
    rows, vocab = logits.shape
    ids = jnp.where(ids >= 0, ids, vocab)
    return logits.at[jnp.arange(rows)[:, None], ids].add(values, mode="drop")


def _unpack_mask(words: jax.Array, vocab: int) -> jax.Array:
    """u32[R, W] bitmask -> bool[R, V]; bit i % 32 of word i // 32 allows token i."""
    shifts = jnp.arange(32, dtype=jnp.uint32)
    bits = (words.astype(jnp.uint32)[:, :, None] >> shifts) & jnp.uint32(1)
    return bits.reshape(words.shape[0], -1)[:, :vocab].astype(bool)


def _draw(logits: jax.Array, t: SamplingTensors, step_key: jax.Array) -> jax.Array:
    """One categorical draw per row by inverse CDF: one uniform per row, not one per vocabulary entry."""
    keys = _row_keys(t, step_key)
    u = 1.0 - jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)  # (0, 1]
    rows, vocab = logits.shape
    probs = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    # Two levels, so no cumulative sum runs over the whole vocabulary (slow on CPU): the block
    # of DRAW_BLOCK tokens where the cdf reaches u * total, then the token inside it.
    nb = -(-vocab // DRAW_BLOCK)
    blocks = jnp.pad(probs, ((0, 0), (0, nb * DRAW_BLOCK - vocab))).reshape(rows, nb, DRAW_BLOCK)
    block_cdf = jnp.cumsum(jnp.sum(blocks, axis=-1), axis=-1)                       # [R, nb]
    target = u * block_cdf[:, -1]
    j = jnp.minimum(jnp.sum(block_cdf < target[:, None], axis=-1), nb - 1)          # [R]
    before = jnp.where(j > 0, jnp.take_along_axis(block_cdf, jnp.maximum(j - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    inner = jnp.take_along_axis(blocks, j[:, None, None], axis=1)[:, 0]             # [R, DRAW_BLOCK]
    # the first token whose cdf reaches the target has probability > 0 (the cdf is flat over
    # zeros); rounding between the two levels can leave the target past the block's end, so the
    # index stops at the block's last token with probability > 0
    pos = jnp.arange(DRAW_BLOCK)
    i = jnp.sum(before[:, None] + jnp.cumsum(inner, axis=-1) < target[:, None], axis=-1)
    i = jnp.minimum(i, jnp.max(jnp.where(inner > 0, pos, 0), axis=-1))
    return jnp.minimum(j * DRAW_BLOCK + i, vocab - 1).astype(jnp.int32)


def _row_keys(t: SamplingTensors, step_key: jax.Array) -> jax.Array:
    """fold_in(key(seed), position) for seeded rows, fold_in(step_key, row) otherwise."""
    if not jnp.issubdtype(step_key.dtype, jax.dtypes.prng_key):
        step_key = jax.random.wrap_key_data(step_key)
    impl = jax.random.key_impl(step_key)
    seeded = jax.vmap(
        lambda s, p: jax.random.fold_in(jax.random.key(s, impl=impl), p)
    )(t.seed, t.position)
    rows = jnp.arange(t.seed.shape[0], dtype=jnp.uint32)
    unseeded = jax.vmap(lambda i: jax.random.fold_in(step_key, i))(rows)
    return jnp.where(t.has_seed, seeded, unseeded)


# ------------------------------------------------------------------------------ host


@dataclass(frozen=True)
class RowSpec:
    """One row's sampling request as the host knows it; defaults are all neutral."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    position: int = 0
    history: Sequence[int] = ()  # prompt then output token ids, oldest first
    num_output_tokens: int = 0  # how many trailing entries of `history` are output
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    allowed_token_ids: Sequence[int] | None = None
    allowed_bitmask: np.ndarray | None = None  # u32/i32[ceil(V/32)], e.g. from llguidance
    dry: Sequence[tuple[int, float]] = ()  # DRY (token id, penalty) pairs, at most DRY_SLOTS (dry.py)
    mirostat: int = 0  # 0 = off, 1 / 2 = mirostat v1 / v2 (mirostat.py), which replaces top_k, top_p,
    #   min_p and typical_p: build_sampling_tensors sets those neutral for the row
    mirostat_tau: float = MIROSTAT_TAU
    mirostat_eta: float = MIROSTAT_ETA
    mirostat_mu: float = 0.0  # the sequence's mu (mirostat.initial_mu before its first token)
    wants_top_logprobs: bool = False  # the row reads its logprobs, the top-K or the sampled token's alone
    #   (the sampler may skip them otherwise)


def pack_allowed_tokens(token_ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """Bitmask u32[ceil(V/32)] with bit i % 32 of word i // 32 set for each allowed id."""
    ids = np.asarray(token_ids, np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError("allowed token id outside the vocabulary")
    words = np.zeros(-(-vocab_size // 32), np.uint32)
    np.bitwise_or.at(words, ids // 32, (np.uint32(1) << (ids % 32).astype(np.uint32)))
    return words


def build_sampling_tensors(
    rows: Sequence[RowSpec],
    *,
    num_rows_bucket: int,
    vocab_size: int,
    history_len: int,
    max_bias: int,
    with_mask: bool,
) -> SamplingTensors:
    """Numpy SamplingTensors for `rows`, padded to `num_rows_bucket` with greedy rows.

    History keeps the last `history_len` tokens; seeds are taken modulo 2**32.
    """
    if len(rows) > num_rows_bucket:
        raise ValueError(f"{len(rows)} rows exceed the bucket of {num_rows_bucket}")
    n = num_rows_bucket
    rows = [dataclasses.replace(r, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0) if r.mirostat else r for r in rows]

    def column(name: str, pad: float, dtype: type) -> np.ndarray:
        out = np.full(n, pad, dtype)
        out[: len(rows)] = [getattr(r, name) for r in rows]
        return out

    history = np.full((n, history_len), -1, np.int32)
    is_output = np.zeros((n, history_len), bool)
    bias_ids = np.full((n, max_bias), -1, np.int32)
    bias_values = np.zeros((n, max_bias), np.float32)
    dry_ids = np.full((n, DRY_SLOTS), -1, np.int32)
    dry_penalties = np.zeros((n, DRY_SLOTS), np.float32)
    mask = np.full((n, -(-vocab_size // 32)), 0xFFFFFFFF, np.uint32) if with_mask else None
    for i, r in enumerate(rows):
        tail = list(r.history)[-history_len:] if history_len else []
        history[i, : len(tail)] = tail
        outputs = min(r.num_output_tokens, len(tail))
        is_output[i, len(tail) - outputs : len(tail)] = True
        if len(r.logit_bias) > max_bias:
            raise ValueError(f"{len(r.logit_bias)} logit_bias entries exceed {max_bias}")
        for j, (tok, val) in enumerate(r.logit_bias.items()):
            if not 0 <= int(tok) < vocab_size:
                raise ValueError(f"logit_bias token {tok} outside the vocabulary")
            bias_ids[i, j], bias_values[i, j] = int(tok), val
        if len(r.dry) > DRY_SLOTS:
            raise ValueError(f"{len(r.dry)} DRY penalties exceed {DRY_SLOTS}")
        for j, (tok, pen) in enumerate(r.dry):
            if not 0 <= int(tok) < vocab_size:
                raise ValueError(f"DRY token {tok} outside the vocabulary")
            dry_ids[i, j], dry_penalties[i, j] = int(tok), pen
        row_mask = _row_mask(r, vocab_size)
        if row_mask is not None:
            if mask is None:
                raise ValueError("a row restricts tokens but with_mask is False")
            mask[i] = row_mask
    return SamplingTensors(
        temperature=column("temperature", 0.0, np.float32),
        top_k=column("top_k", 0, np.int32),
        top_p=column("top_p", 1.0, np.float32),
        min_p=column("min_p", 0.0, np.float32),
        typical_p=column("typical_p", 1.0, np.float32),
        presence_penalty=column("presence_penalty", 0.0, np.float32),
        frequency_penalty=column("frequency_penalty", 0.0, np.float32),
        repetition_penalty=column("repetition_penalty", 1.0, np.float32),
        seed=np.array([(r.seed or 0) % 2**32 for r in rows] + [0] * (n - len(rows)), np.uint32),
        has_seed=np.array([r.seed is not None for r in rows] + [False] * (n - len(rows))),
        position=column("position", 0, np.int32),
        history=history,
        history_is_output=is_output,
        bias_ids=bias_ids,
        bias_values=bias_values,
        wants_top_logprobs=column("wants_top_logprobs", False, np.bool_),
        allowed_mask=mask,
        masked=np.array([r.allowed_bitmask is not None or r.allowed_token_ids is not None for r in rows]
                        + [False] * (n - len(rows))) if with_mask else None,
        dry_ids=dry_ids,
        dry_penalties=dry_penalties,
        mirostat=column("mirostat", 0, np.int32),
        mirostat_tau=column("mirostat_tau", MIROSTAT_TAU, np.float32),
        mirostat_eta=column("mirostat_eta", MIROSTAT_ETA, np.float32),
        mirostat_mu=column("mirostat_mu", 0.0, np.float32),
    )


def _row_mask(r: RowSpec, vocab_size: int) -> np.ndarray | None:
    """The row's allowed-token bitmask, or None when it allows everything."""
    if r.allowed_bitmask is not None:
        return np.asarray(r.allowed_bitmask).view(np.uint32)
    if r.allowed_token_ids is not None:
        return pack_allowed_tokens(r.allowed_token_ids, vocab_size)
    return None

