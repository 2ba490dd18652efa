"""Raw logprob probes (/v1/score, /v1/decide): the raw logprob of each `raw_logprob_ids` entry where a token
was sampled. The step input side is the base logit_bias (runtime/core/step_inputs.py), whose first slots they fill."""
from __future__ import annotations

from imp_jax.runtime.features.base import Accepted, Feature


class ProbesFeature(Feature):
    name = "probes"

    @classmethod
    def active(cls, req, params) -> bool:
        return bool(params.raw_logprob_ids)

    def accepted(self, seq, tok: Accepted) -> None:
        ids = seq.params.raw_logprob_ids
        if ids:   # the probes fill the first logit_bias slots, in order
            tok.raw = {t: float(tok.out.bias_raw_logprobs[tok.row, i]) for i, t in enumerate(dict.fromkeys(ids))}
