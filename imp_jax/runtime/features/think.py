"""Think blocks (runtime/replies/reasoning.py, harmony.py) as a feature: a tracker per sequence, the forced end's
token mask, each token's kind (think, marker, answer), and the reasoning token count in usage."""
from __future__ import annotations

from typing import Any

import numpy as np

from imp_jax.runtime.features.base import Accepted, Feature, Services
from imp_jax.runtime.replies.harmony import reply_markers
from imp_jax.runtime.replies.reasoning import default_think_budget
from imp_jax.runtime.execution.sampling import pack_allowed_tokens


class ThinkFeature(Feature):
    """Splits a reply into reasoning and answer when the request asks (`GenerationRequest.reasoning`)."""

    name = "reasoning"

    def __init__(self, services: Services):
        super().__init__(services)
        # how the model's replies split into reasoning and answer (None: they do not); the engine's model fact
        self.markers = reply_markers(services.tokenizer)

    def start(self, seq, state) -> None:
        if self.markers is not None and state.request.reasoning:
            budget = state.request.reasoning_budget
            if budget is None:   # the answer keeps its reserve of max_tokens (reasoning.py answer_reserve)
                budget = default_think_budget(seq.max_tokens)
            seq.reasoning = self.markers.tracker(state.request.prompt_ids, budget, state.request.tool_calls)

    def needs_newest(self, seq) -> bool:
        return seq.reasoning is not None and seq.reasoning.may_force   # a forced end's mask follows it

    def holds_drafts(self, seq) -> bool:
        r = seq.reasoning   # a step may accept its newest token and every draft: all of them may reach the budget
        return r is not None and (r.may_force_within(1 + self.s.config.speculative_max_draft)
                                  or r.forced_token is not None)

    def masks(self, rows, masks: dict[int, np.ndarray]) -> None:
        """A forced think end allows its next token only (before any grammar: `features/__init__` order)."""
        for i, seq in rows:
            r = seq.reasoning
            if r is not None and r.forced_token is not None:
                masks[i] = pack_allowed_tokens([r.forced_token], self.s.vocab_size)

    def accepted(self, seq, tok: Accepted) -> None:
        if seq.reasoning is not None:
            tok.kind = seq.reasoning.observe(tok.token)

    def usage(self, state, usage: dict[str, Any]) -> None:
        usage["reasoning_tokens"] = sum(s.reasoning.num_reasoning_tokens for s in state.seqs if s.reasoning is not None)

    def end_thinking(self, seqs: list) -> str:
        """Force the end of the sequences' think blocks: "ending", "already_closed" or "not_thinking"."""
        trackers = [s.reasoning for s in seqs]
        if any(t is None for t in trackers):
            return "not_thinking"
        answers = [t.force_end() for t in trackers]
        return "ending" if "ending" in answers else "already_closed"
