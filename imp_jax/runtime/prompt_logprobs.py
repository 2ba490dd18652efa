"""Prompt logprobs: the raw model distribution at every prompt position (vLLM's prompt_logprobs).

The prompt is forwarded alone, chunk by chunk, through blocks borrowed from the pool under a
private prefix-cache key, so it neither reuses nor overwrites blocks other requests share;
the blocks go back to the pool before the request is scheduled.
"""
from __future__ import annotations

import uuid
from typing import Sequence

import numpy as np

from imp_jax.errors import InvalidRequestError
from imp_jax.runtime.batch import SeqChunk, build_step_batch
from imp_jax.runtime.kv_blocks import BlockTable, KVBlockPool
from imp_jax.runtime.request import TokenLogprob
from imp_jax.runtime.step import CompiledStep


def compute_prompt_logprobs(step_fn: CompiledStep, pool: KVBlockPool, ids: Sequence[int],
                            top_k: int) -> list[TokenLogprob | None]:
    """Entry 0 is None; entry i is token i's logprob given tokens < i, its rank, and the top `top_k`."""
    table = BlockTable()
    key = ("prompt_logprobs", uuid.uuid4().hex)
    if not pool.allocate(table, ids, len(ids), extra_key=key):
        raise InvalidRequestError("not enough free KV blocks to compute prompt_logprobs now; retry later",
                                  param="prompt_logprobs", status=503, code="overloaded")
    entries: list[TokenLogprob | None] = [None]
    T = step_fn.score_tokens
    try:
        for start in range(0, len(ids), T):
            chunk = list(ids[start:start + T])
            batch = build_step_batch([SeqChunk(chunk, start, table.block_ids)], num_tokens=T, num_seqs=1,
                                     max_blocks=step_fn.shapes.max_blocks, block_size=pool.block_size)
            targets = np.zeros(T, np.int32)
            nxt = list(ids[start + 1:start + 1 + len(chunk)])
            targets[:len(nxt)] = nxt
            lp, rank, top_ids, top_lp = step_fn.score(batch, targets)
            for j, tok in enumerate(nxt):
                top = [(int(t), float(v)) for t, v in zip(top_ids[j, :top_k], top_lp[j, :top_k])]
                entries.append(TokenLogprob(int(tok), float(lp[j]), top, int(rank[j])))
    finally:
        pool.free(table)
    return entries
