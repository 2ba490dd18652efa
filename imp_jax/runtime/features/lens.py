"""logit_lens (runtime/decoding/logit_lens.py) as a feature: per-layer readouts of each sampled token, attached to its
logprobs by a second program run after the step is read."""
from __future__ import annotations

import dataclasses

from imp_jax.errors import InvalidRequestError
from imp_jax.runtime.features.base import Accepted, Feature
from imp_jax.runtime.decoding.logit_lens import lens_batch, lens_layers
from imp_jax.runtime.request import check_reply_size
from imp_jax.runtime.scheduling.sequence import SeqStatus


class LensFeature(Feature):
    name = "logit_lens"
    drafts_ok = False   # its program reads one token

    @classmethod
    def active(cls, req, params) -> bool:
        return params.logit_lens is not None

    def check(self, req, params):
        """logit_lens needs a model that returns per-layer residuals, one host, and implies logprobs."""
        if params.logit_lens is None:
            return params
        step_fn = self.s.step_fn
        if not step_fn.supports_lens or step_fn.leader is not None:
            why = ("this model's architecture does not return per-layer residuals" if not step_fn.supports_lens
                   else "it does not run multi-host")
            raise InvalidRequestError(f"'logit_lens' is not supported here: {why}", code="not_supported",
                                      param="logit_lens")
        params = params if params.logprobs is not None else dataclasses.replace(params, logprobs=0)
        prompt_len = len(req.prompt_ids)
        check_reply_size(params, prompt_len, params.max_tokens or self.s.max_model_len - prompt_len,
                         lens_layers=getattr(getattr(self.s.model, "config", None), "num_layers", 0))   # a user model may not say
        return params

    def needs_newest(self, seq) -> bool:
        return seq.params.logit_lens is not None   # its program runs after the read

    def accepted(self, seq, tok: Accepted) -> None:
        """The layers for the token just sampled (its step read, its KV still held)."""
        if seq.params.logit_lens is None or seq.status is not SeqStatus.RUNNING or not tok.logprobs:
            return
        step_fn = self.s.step_fn
        batch = lens_batch(seq.all_ids, seq.table.block_ids, seq.lora_slot, step_fn.shapes.max_blocks,
                           self.s.config.block_size)
        tok.logprobs[0].lens = lens_layers(lambda b, t: step_fn.lens(b, t, [seq.table]), batch, tok.token,
                                           seq.params.logit_lens)
