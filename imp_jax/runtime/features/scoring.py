"""prompt_logprobs (runtime/decoding/prompt_logprobs.py) as a feature: the first sequence's prompt prefills through the
scheduler under a private prefix-cache key; the part of each chunk before the last prompt token runs through
the scoring program (`runs_tokens` / `run_tokens`); the entries ride on the request's first event."""
from __future__ import annotations

import uuid

from imp_jax.runtime.features.base import Accepted, Feature
from imp_jax.runtime.decoding.prompt_logprobs import PromptScoring


class ScoringFeature(Feature):
    name = "prompt_logprobs"

    def acquire(self, state) -> None:
        k = state.params.prompt_logprobs
        if k is not None:
            state.ext[self.name] = PromptScoring(state.request.prompt_ids, k)

    def start(self, seq, state) -> None:
        if self.name in state.ext and seq.index == 0:
            seq.ext[self.name] = state.ext[self.name]
            seq.ext["private_cache"] = uuid.uuid4().hex   # every prompt token computed, none served to others

    def runs_tokens(self, chunk) -> int:
        scoring = chunk.seq.ext.get(self.name)
        if scoring is None or chunk.drafts:
            return 0
        return scoring.to_score(chunk.seq.num_computed, chunk.num_tokens)

    def run_tokens(self, seq, n: int) -> None:
        seq.ext[self.name].launch(self.s.step_fn, seq.num_computed, n, seq.table, seq.lora_slot,
                                  self.s.config.block_size)

    def accepted(self, seq, tok: Accepted) -> None:
        """At the first token: the prompt's entries, for the request's first event (OutputStage)."""
        scoring = seq.ext.pop(self.name, None)
        if scoring is not None:
            tok.prompt_logprobs = scoring.read()
