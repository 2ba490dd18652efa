"""Structured output (runtime/decoding/constraints.py) as a feature: a grammar matcher per sequence, its allowed-token
masks filled in one call for the whole batch, and each answer token checked against it."""
from __future__ import annotations

import time

import numpy as np

from imp_jax.runtime.decoding.constraints import GrammarConstraints
from imp_jax.runtime.features.base import Accepted, EndSequence, Feature, Services
from imp_jax.runtime.replies.reasoning import ANSWER


def matcher(seq):
    """The sequence's GrammarMatcher, or None when unconstrained."""
    return seq.ext.get(GrammarFeature.name)


class GrammarFeature(Feature):
    """`GenerationRequest.constraint`: the answer (outside a think block) follows the grammar."""

    name = "grammar"
    drafts_ok = False   # each row's mask follows the token before it

    def __init__(self, services: Services):
        super().__init__(services)
        self.constraints = GrammarConstraints.for_tokenizer(services.tokenizer, services.vocab_size)

    @classmethod
    def active(cls, req, params) -> bool:
        return bool(req.constraint)

    def prepare(self, req) -> None:
        """Compile the request's grammar (up to ~1 s) before admission, off the engine thread."""
        if req.constraint and req.compiled_constraint is None:
            req.compiled_constraint = self.constraints.prepare(req.constraint)

    def start(self, seq, state) -> None:
        req = state.request
        if req.constraint:   # a copy of the prepared grammar (compiled here only for callers that skip prepare)
            seq.ext[self.name] = self.constraints.matcher(req.constraint, req.compiled_constraint)

    def needs_newest(self, seq) -> bool:
        return self.name in seq.ext

    def masks(self, rows, masks: dict[int, np.ndarray]) -> None:
        """Grammar rows outside a think block (and without a forced token's mask), with `<think>` allowed too
        while the block may still open; filled in one call that leaves the GIL and runs them in parallel."""
        grammar_rows = [(i, seq) for i, seq in rows if i not in masks and self.name in seq.ext
                        and (seq.reasoning is None or seq.reasoning.constrained)]
        if not grammar_rows:
            return
        t0 = time.perf_counter()
        words = np.empty((len(grammar_rows), self.constraints.mask_words), np.int32)
        self.constraints.fill_masks([seq.ext[self.name] for _, seq in grammar_rows], words)
        bits = words.view(np.uint32)
        for k, (i, seq) in enumerate(grammar_rows):
            think = seq.reasoning
            if think is not None and think.may_open:
                start = think.markers.start_id
                bits[k, start // 32] |= np.uint32(1 << (start % 32))
            masks[i] = words[k]
        c = self.s.counters
        c.mask_steps += 1
        c.mask_rows += len(grammar_rows)
        c.mask_seconds += time.perf_counter() - t0

    def accepted(self, seq, tok: Accepted) -> None:
        m = seq.ext.get(self.name)
        if (m is not None and tok.kind == ANSWER and (seq.reasoning is None or seq.reasoning.constrained)
                and not m.accept(tok.token)):
            # the grammar allowed no token the request's logit_bias left (the sampler drew from nothing)
            raise EndSequence(f"the output constraint allowed no token the request's logit_bias permits "
                              f"({m.failed})")
