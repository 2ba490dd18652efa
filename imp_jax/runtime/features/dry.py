"""DRY (runtime/decoding/dry.py) as a feature: the row's (token, penalty) slots from the sequence's DryState, which
follows its history incrementally (never a scan of the whole history per step)."""
from __future__ import annotations

from typing import Any

from imp_jax.runtime.decoding.dry import BreakerTable, DryState, top_slots
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
        state = seq.ext.get(self.name)
        if state is None:   # its first DRY row; it catches up with accepted or rewound tokens from then on
            state = seq.ext[self.name] = DryState(d, self.breakers.breakers(d.sequence_breakers), self.s.max_model_len)
        fields["dry"] = top_slots(state.penalties(seq.prompt_ids, seq.output_ids))
