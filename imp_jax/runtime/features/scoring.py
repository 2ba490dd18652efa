"""prompt_logprobs (runtime/prompt_logprobs.py) as a feature: the request's prompt is scored first, one chunk
per loop iteration between the regular steps, through blocks borrowed for it; its sequences join the
scheduler when the scoring ends."""
from __future__ import annotations

from imp_jax.runtime.features.base import Feature
from imp_jax.runtime.prompt_logprobs import PromptScoring


class ScoringFeature(Feature):
    name = "prompt_logprobs"

    def __init__(self, services):
        super().__init__(services)
        self.queue: list = []   # RequestStates being scored, oldest first

    def acquire(self, state) -> None:
        k = state.params.prompt_logprobs
        if k is None:
            return
        lora = state.ext.get("lora")
        state.ext[self.name] = PromptScoring.begin(self.s.pool, state.request.prompt_ids, k,
                                                   lora.slot if lora is not None else 0)
        state.held = True
        self.queue.append(state)

    def busy(self) -> bool:
        return bool(self.queue)

    def side_step(self) -> int:
        """One chunk of the oldest prompt being scored; a scored prompt's sequences join the scheduler."""
        if not self.queue:
            return 0
        state = self.queue[0]
        scoring = state.ext[self.name]
        scoring.run_chunk(self.s.step_fn, self.s.config.block_size)
        if scoring.done:
            state.prompt_logprobs = scoring.entries
            self.release(state)
            state.held = False
            for seq in state.seqs:
                self.s.scheduler.add(seq)
        return 1

    def release(self, state) -> None:
        scoring = state.ext.pop(self.name, None)
        if scoring is not None:
            scoring.release(self.s.pool)
            self.queue.remove(state)
