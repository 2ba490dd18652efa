"""A request in the engine core: its sequences, where its events go, and what it holds until it ends."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from imp_jax.runtime.request import EngineEvent, GenerationRequest, SamplingParams
from imp_jax.runtime.scheduling.sequence import Sequence

Emit = Callable[[EngineEvent], None]


@dataclasses.dataclass(eq=False)
class RequestState:
    """One admitted request, from admission to its last event."""

    request: GenerationRequest
    params: SamplingParams               # resolved (runtime/defaults.py) and checked by every feature
    max_tokens: int
    emit: Emit
    seqs: list[Sequence] = dataclasses.field(default_factory=list)
    num_open: int = 0
    drafts_ok: bool = True               # no active feature forbids speculation (Feature.drafts_ok)
    prompt_logprobs: list | None = None   # sent once, on index 0's first event
    ext: dict[str, Any] = dataclasses.field(default_factory=dict)   # per-request feature state, by name

    @property
    def request_id(self) -> str:
        return self.request.request_id
