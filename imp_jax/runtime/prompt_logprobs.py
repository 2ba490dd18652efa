"""Prompt logprobs: the raw model distribution at every prompt position (vLLM's prompt_logprobs).

A request that asks for them first has its prompt scored, one chunk per engine step between the
regular steps, so other requests keep streaming meanwhile. The prompt is forwarded alone through
blocks borrowed from the pool under a private prefix-cache key, so it neither reuses nor
overwrites blocks other requests share; the blocks go back to the pool when the scoring ends,
and only then is the request's generation scheduled.
"""
from __future__ import annotations

import dataclasses
import uuid
from typing import Sequence

import numpy as np

from imp_jax.errors import InvalidRequestError
from imp_jax.runtime.batch import SeqChunk, build_step_batch
from imp_jax.runtime.kv_blocks import BlockTable, KVBlockPool
from imp_jax.runtime.request import TokenLogprob
from imp_jax.runtime.step import CompiledStep


@dataclasses.dataclass
class PromptScoring:
    """One prompt being scored: entry 0 is None; entry i is token i's logprob given tokens < i,
    its rank, and the top `top_k`."""

    ids: Sequence[int]
    top_k: int
    table: BlockTable
    entries: list[TokenLogprob | None] = dataclasses.field(default_factory=lambda: [None])
    start: int = 0
    lora_slot: int = 0

    @classmethod
    def begin(cls, pool: KVBlockPool, ids: Sequence[int], top_k: int, lora_slot: int = 0) -> "PromptScoring":
        """Borrow the blocks the whole prompt needs (a 503 when the pool cannot lend them now)."""
        table = BlockTable()
        if not pool.allocate(table, ids, len(ids), extra_key=("prompt_logprobs", uuid.uuid4().hex)):
            raise InvalidRequestError("not enough free KV blocks to compute prompt_logprobs now; retry later",
                                      param="prompt_logprobs", status=503, code="overloaded")
        return cls(ids, top_k, table, lora_slot=lora_slot)

    @property
    def done(self) -> bool:
        return self.start >= len(self.ids)

    def run_chunk(self, step_fn: CompiledStep, block_size: int) -> None:
        """Score the next chunk of up to `step_fn.score_tokens` prompt tokens."""
        T = step_fn.score_tokens
        chunk = list(self.ids[self.start:self.start + T])
        batch = build_step_batch([SeqChunk(chunk, self.start, self.table.block_ids, self.lora_slot)], num_tokens=T,
                                 num_seqs=1, max_blocks=step_fn.shapes.max_blocks, block_size=block_size,
                                 with_tables=False)
        targets = np.zeros(T, np.int32)
        nxt = list(self.ids[self.start + 1:self.start + 1 + len(chunk)])
        targets[:len(nxt)] = nxt
        lp, rank, top_ids, top_lp = step_fn.score(batch, targets, [self.table])
        for j, tok in enumerate(nxt):
            top = [(int(t), float(v)) for t, v in zip(top_ids[j, :self.top_k], top_lp[j, :self.top_k])]
            self.entries.append(TokenLogprob(int(tok), float(lp[j]), top, int(rank[j])))
        self.start += len(chunk)

    def release(self, pool: KVBlockPool) -> None:
        pool.free(self.table)
