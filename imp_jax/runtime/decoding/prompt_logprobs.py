"""Prompt logprobs: the raw model distribution at every prompt position (vLLM's prompt_logprobs).

The request's first sequence prefills its prompt through the scheduler like any prompt (its blocks
reserved at admission, its chunks under the step's token budget), under a private prefix-cache key
so every prompt token is computed. The part of each chunk before the prompt's last token runs
through the scoring program instead of the step (features/scoring.py), its outputs read when the
sequence's first token is; the last token runs in the step and samples as usual.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from imp_jax.runtime.execution.batch import SeqChunk, build_step_batch
from imp_jax.runtime.kv.kv_blocks import BlockTable
from imp_jax.runtime.request import TokenLogprob
from imp_jax.runtime.execution.step import CompiledStep


@dataclasses.dataclass
class PromptScoring:
    """One prompt being scored: entry 0 is None; entry i is token i's logprob given tokens < i, its rank,
    and the top `top_k`. `launched` holds the chunks run, (start, count, device outputs), oldest first."""

    ids: Sequence[int]
    top_k: int
    entries: list[TokenLogprob | None] = dataclasses.field(default_factory=lambda: [None])
    launched: list[tuple[int, int, Any]] = dataclasses.field(default_factory=list)

    def to_score(self, start: int, n: int) -> int:
        """Of `n` tokens from `start`, how many come before the prompt's last token (scored, not stepped)."""
        return max(0, min(start + n, len(self.ids) - 1) - start)

    def launch(self, step_fn: CompiledStep, start: int, n: int, table: BlockTable, lora_slot: int,
               block_size: int) -> None:
        """Run prompt tokens start..start+n-1 through the scoring program (their KV written as a prefill's)."""
        T = step_fn.score_tokens
        batch = build_step_batch([SeqChunk(list(self.ids[start:start + n]), start, table.block_ids, lora_slot)],
                                 num_tokens=T, num_seqs=1, max_blocks=step_fn.shapes.max_blocks,
                                 block_size=block_size, with_tables=False)
        targets = np.zeros(T, np.int32)
        targets[:n] = self.ids[start + 1:start + 1 + n]
        self.launched.append((start, n, step_fn.launch_score(batch, targets, [table])))

    def read(self) -> list[TokenLogprob | None]:
        """Every launched chunk's entries, in order; a chunk run again (the sequence was preempted and
        recomputed) replaces what followed its start."""
        for start, n, out in self.launched:
            lp, rank, top_ids, top_lp = (np.asarray(x) for x in out)
            del self.entries[start + 1:]
            for j in range(n):
                top = [(int(t), float(v)) for t, v in zip(top_ids[j, :self.top_k], top_lp[j, :self.top_k])]
                self.entries.append(TokenLogprob(int(self.ids[start + 1 + j]), float(lp[j]), top, int(rank[j])))
        self.launched = []
        return self.entries
