"""Classifier-free guidance (runtime/decoding/cfg.py) as a feature: a shadow sequence per choice, fed each token its
main samples, and the step's (shadow row, scale) inputs."""
from __future__ import annotations

from typing import Any, Sequence as Seq

from imp_jax.runtime.decoding import cfg as guidance
from imp_jax.runtime.features.base import Accepted, Feature
from imp_jax.runtime.scheduling.sequence import Sequence


class CfgFeature(Feature):
    name = "cfg"
    drafts_ok = False   # the shadow pair samples together

    @classmethod
    def active(cls, req, params) -> bool:
        return req.cfg_scale != 1

    def check(self, req, params):
        max_tokens = params.max_tokens or self.s.max_model_len - len(req.prompt_ids)
        guidance.check_request(req, max_tokens, self.s.max_model_len, self.s.vocab_size, self.s.pool,
                               self.s.baseline_free_blocks)
        return params

    def start(self, seq, state) -> None:
        if state.request.cfg_scale != 1:   # after the adapter's start: the shadow shares its slot
            attach_shadow(seq, state.request.cfg_prompt_ids)

    def needs_newest(self, seq) -> bool:
        return seq.shadow is not None or seq.main is not None   # a shadow is fed its main's token on the host

    def step_extras(self, chunks, num_rows: int) -> dict[str, Any]:
        return {"cfg": guidance.step_inputs(chunks, num_rows)}

    def accepted(self, seq, tok: Accepted) -> None:
        if seq.shadow is not None:
            guidance.feed(seq.shadow, tok.token)


def attach_shadow(main: Sequence, prompt_ids: Seq[int]) -> Sequence:
    """Give `main` its shadow: the same request, choice and adapter over `prompt_ids`. Its detokenizer and
    stop matcher are the main's, never used (a shadow emits nothing)."""
    shadow = Sequence(request=main.request, index=main.index, params=main.params, max_tokens=main.max_tokens,
                      detok=main.detok, stops=main.stops, prompt_ids=list(prompt_ids),
                      lora_slot=main.lora_slot, lora_key=main.lora_key, main=main)
    main.shadow = shadow
    return shadow
