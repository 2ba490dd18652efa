"""banned_strings / banned_regex (runtime/decoding/banned.py) as a feature: the phrases and rewind budget per request,
a filter per sequence, and the bans at a rewound position in the row's logit_bias. Holding text back and
rewinding are the output stage's (runtime/core/output.py), which reads `seq.banned`."""
from __future__ import annotations

from typing import Any

from imp_jax.errors import InvalidRequestError
from imp_jax.runtime.decoding.banned import BannedFilter, BannedPhrases, RewindBudget
from imp_jax.runtime.features.base import Feature


class BannedFeature(Feature):
    name = "banned"
    drafts_ok = False   # a rewind takes back tokens the drafts after them would have followed

    @classmethod
    def active(cls, req, params) -> bool:
        return bool(params.banned_strings or params.banned_regex)

    def check(self, req, params):
        """400 with what a rewind cannot undo or follow: an output constraint, mirostat, classifier-free
        guidance, raw logprob probes."""
        if not self.active(req, params):
            return params
        field = "banned_strings" if params.banned_strings else "banned_regex"
        clash = ("structured output or enforced tool calls" if req.constraint else
                 "'mirostat'" if params.mirostat else
                 "'cfg_scale'" if req.cfg_scale != 1 else
                 "raw logprob probes (/v1/score, /v1/decide)" if params.raw_logprob_ids else None)
        if clash is not None:
            raise InvalidRequestError(f"'{field}' cannot be combined with {clash}", param=field)
        return params

    def acquire(self, state) -> None:
        p = state.params
        if self.active(state.request, p):
            state.ext[self.name] = (BannedPhrases(p.banned_strings, p.banned_regex), RewindBudget())

    def start(self, seq, state) -> None:
        if self.name in state.ext:
            seq.banned = BannedFilter(*state.ext[self.name])

    def needs_newest(self, seq) -> bool:
        return seq.banned is not None   # a rewind lands before the next step

    def row(self, seq, fields: dict[str, Any], num_output: int) -> None:
        """The tokens a phrase was rewound from at this position, banned (as many as the sampler's bias
        slots leave room for, newest first)."""
        rewound = seq.banned.bans.get(num_output) if seq.banned is not None else None
        if not rewound:
            return
        bias = fields["logit_bias"]
        room = self.s.step_fn.shapes.max_bias - len(bias)
        new = [t for t in reversed(rewound) if t not in bias][:max(0, room)]
        fields["logit_bias"] = {**bias, **dict.fromkeys([t for t in rewound if t in bias] + new, float("-inf"))}
