"""DRY (runtime/dry.py) as a feature: the row's (token, penalty) slots from the sequence's history."""
from __future__ import annotations

from typing import Any

from imp_jax.runtime.dry import BreakerTable, repeat_penalties, top_slots
from imp_jax.runtime.features.base import Feature, Services


class DryFeature(Feature):
    name = "dry"
    drafts_ok = False   # the penalties would need the drafts' own

    def __init__(self, services: Services):
        super().__init__(services)
        self.breakers = BreakerTable(services.tokenizer, services.vocab_size)

    @classmethod
    def active(cls, req, params) -> bool:
        return params.dry.on

    def needs_newest(self, seq) -> bool:
        return seq.params.dry.on   # the penalties follow the whole history, the newest token included

    def row(self, seq, fields: dict[str, Any], num_output: int) -> None:
        d = seq.params.dry
        if not d.on:
            return
        if seq.pending:
            raise RuntimeError(f"sequence {seq.seq_id}: a DRY row was scheduled before its newest token was read")
        n = self.s.max_model_len if d.penalty_last_n == -1 else min(d.penalty_last_n, self.s.max_model_len)
        history = seq.all_ids[max(0, seq.num_known - n):]
        penalties = repeat_penalties(history, d, self.breakers.breakers(d.sequence_breakers), self.s.max_model_len)
        fields["dry"] = top_slots(penalties)
