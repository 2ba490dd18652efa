"""Classifier-free guidance (cfg_scale): each choice has a shadow sequence that decodes another
prompt (the conversation without its system message, or with cfg_negative_prompt as system) in
the same steps; the choice samples from l_b + s (l_a - l_b), l_a its own logits, l_b the shadow's.

The pair's contract, kept by the scheduler and checked by the engine:
- the shadow never waits or runs on its own: it is admitted, grown, preempted and freed with its
  main sequence (Scheduler), and is in neither of the scheduler's lists;
- the main row samples only in a step where the shadow's chunk reaches the shadow's newest token
  (`split_budget`), so every main sampling row has a shadow row in its step;
- the shadow is fed each token its main samples when the step is read, and emits nothing.
Rows without a shadow get their logits unchanged, bit for bit (`guide`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from imp_jax.errors import InvalidRequestError
from imp_jax.runtime.request import MAX_CFG_SCALE
from imp_jax.runtime.execution.truncation import cond

if TYPE_CHECKING:
    from imp_jax.runtime.kv.kv_blocks import KVBlockPool
    from imp_jax.runtime.request import GenerationRequest
    from imp_jax.runtime.scheduling.scheduler import ScheduledChunk
    from imp_jax.runtime.scheduling.sequence import Sequence


def guide(logits: jax.Array, shadow_rows: jax.Array, scale: jax.Array, dynamic_skips: bool = True) -> jax.Array:
    """Row r with shadow_rows[r] >= 0: l_b + scale[r] * (l_r - l_b), l_b = logits[shadow_rows[r]]; other rows
    as they are, bit for bit."""
    def combine(x: jax.Array) -> jax.Array:
        on = shadow_rows >= 0
        l_b = x[jnp.maximum(shadow_rows, 0)]
        return jnp.where(on[:, None], l_b + scale[:, None] * (x - l_b), x)
    return cond(dynamic_skips, jnp.any(shadow_rows >= 0), combine, lambda x: x, logits)


def split_budget(main_left: int, shadow_left: int, budget: int, slots: int) -> tuple[int, int]:
    """Tokens (main, shadow) a pair runs this step, each sequence having `*_left` >= 1 tokens without KV.

    Both whole when they fit (then both reach their newest token: the main samples, the shadow gives
    its logits row); else each prefills short of its newest token, shadow first, so neither samples
    and the pair's remainders shrink to a decode step's 1 + 1."""
    if slots < 2:
        return 0, 0
    if main_left + shadow_left <= budget:
        return main_left, shadow_left
    m = min(shadow_left - 1, budget)
    return min(main_left - 1, budget - m), m


def guidance_inputs(shadow_of: dict[int, int], scales: dict[int, float], num_rows: int
                    ) -> tuple[np.ndarray, np.ndarray] | None:
    """The step's (shadow row [S], scale [S]) from {main row: shadow row} and {main row: scale}; None: no CFG row."""
    if not shadow_of:
        return None
    rows = np.full(num_rows, -1, np.int32)
    scale = np.ones(num_rows, np.float32)
    for r, j in shadow_of.items():
        rows[r], scale[r] = j, scales[r]
    return rows, scale


# ---------------------------------------------------------------------------- host


def check_request(req: "GenerationRequest", max_tokens: int, max_model_len: int, vocab_size: int,
                  pool: "KVBlockPool", pool_blocks: int) -> None:
    """400 unless the request's guidance can run: a scale in [1, 10] and, when it is on, a shadow
    prompt that fits the context beside the output and the pool beside the main prompt."""
    if not 1.0 <= req.cfg_scale <= MAX_CFG_SCALE:
        raise InvalidRequestError(f"'cfg_scale' must be in [1, {MAX_CFG_SCALE:g}] (1 = off)", param="cfg_scale")
    if req.cfg_scale == 1.0:
        return
    ids = req.cfg_prompt_ids
    if not ids:
        raise InvalidRequestError("'cfg_scale' needs a shadow prompt (a system message to leave out, or "
                                  "cfg_negative_prompt)", param="cfg_scale")
    if any(not 0 <= t < vocab_size for t in ids):
        raise InvalidRequestError(f"shadow prompt token ids must be in [0, {vocab_size})", param="cfg_negative_prompt")
    if len(ids) + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"the CFG shadow prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceeds this model's "
            f"context of {max_model_len} tokens", code="context_length_exceeded", param="cfg_negative_prompt")
    if pool.num_blocks_for(len(req.prompt_ids) + 1) + pool.num_blocks_for(len(ids) + 1) > pool_blocks:
        raise InvalidRequestError(
            f"the prompt and its CFG shadow need more than the pool's {pool_blocks} KV blocks; raise "
            "--num-kv-blocks or --kv-cache-memory", code="context_length_exceeded", param="cfg_scale")


def feed(shadow: "Sequence", token: int) -> None:
    """The main sampled `token`: the shadow continues with it (its step's row was the guidance's l_b)."""
    if shadow.pending:
        shadow.pending -= 1
    shadow.output_ids.append(token)


def step_inputs(chunks: "list[ScheduledChunk]", num_rows: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The step's guidance inputs (shadow row [S], scale [S]) for its sampling main rows; None without any.
    A main row that samples without its shadow's newest token in the step breaks the pair's contract."""
    where = {id(c.seq): i for i, c in enumerate(chunks) if c.seq.main is not None}
    if not where:
        return None
    shadow_of, scales = {}, {}
    for i, c in enumerate(chunks):
        if c.seq.shadow is None or not c.samples:
            continue
        j = where.get(id(c.seq.shadow))
        if j is None or not chunks[j].samples:
            raise RuntimeError(f"sequence {c.seq.seq_id} samples without its CFG shadow's newest token")
        shadow_of[i], scales[i] = j, c.seq.request.cfg_scale
    return guidance_inputs(shadow_of, scales, num_rows)


def kv_blocks(pool: "KVBlockPool", seq: "Sequence") -> int:
    """Blocks the sequence's known tokens need, with its CFG shadow's."""
    n = pool.num_blocks_for(seq.num_known)
    return n if seq.shadow is None else n + pool.num_blocks_for(seq.shadow.num_known)
