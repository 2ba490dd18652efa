"""Mirostat (runtime/execution/mirostat.py) as a feature: the sequence's running surprise bound mu, handed to its row
and read back from the step that sampled with it. The smallest whole feature: docs/ARCHITECTURE.md shows it."""
from __future__ import annotations

from typing import Any

from imp_jax.runtime.features.base import Accepted, Feature
from imp_jax.runtime.execution.mirostat import initial_mu


class MirostatFeature(Feature):
    name = "mirostat"
    drafts_ok = False   # each row's mu follows the token before it

    @classmethod
    def active(cls, req, params) -> bool:
        return bool(params.mirostat)

    def start(self, seq, state) -> None:
        if seq.params.mirostat:
            seq.ext[self.name] = initial_mu(seq.params.mirostat_tau)

    def needs_newest(self, seq) -> bool:
        return bool(seq.params.mirostat)   # the next row's mu is this step's output

    def row(self, seq, fields: dict[str, Any], num_output: int) -> None:
        p = seq.params
        if p.mirostat:
            fields.update(mirostat=p.mirostat, mirostat_tau=p.mirostat_tau, mirostat_eta=p.mirostat_eta,
                          mirostat_mu=seq.ext[self.name])

    def accepted(self, seq, tok: Accepted) -> None:
        if seq.params.mirostat:
            seq.ext[self.name] = float(tok.out.mirostat_mu[tok.row])
