"""The queues in front of the engines, as the server counts them: admitted generation requests without a
first event, and embedding / rerank inputs on the encoders.

A generation request joins when it is submitted and leaves when its first event arrives (its prompt is
prefilled, it was refused, or it ended) or it is abandoned; an encoder request holds its inputs' places
until its vectors are back (the encoder answers all at once). Counting on the server, at submit
time, is what makes the caps hold under a burst: the engine thread learns of a request only
when it drains its inbox, after the whole burst has been let in.
"""
from __future__ import annotations

import dataclasses

from imp_jax.server.errors import Refusal

RETRY_AFTER_S = 1


@dataclasses.dataclass(frozen=True)
class GateNames:
    """How a gate's refusals name what it counts, and the flags that set its caps."""

    items: str = "requests"
    tokens: str = "prompt tokens"
    state: str = "waiting for their first token"
    items_flag: str = "--max-queued-requests"
    tokens_flag: str = "--max-queued-tokens"


ENCODER_NAMES = GateNames("embedding inputs", "input tokens", "queued or running on the encoders", "--max-queued-embedding-inputs",
                          "--max-queued-embedding-tokens")


class Ticket:
    """One request's place in the queue; `release()` (idempotent) gives it back."""

    def __init__(self, gate: AdmissionGate, prompt_tokens: int, items: int = 1):
        self._gate, self.prompt_tokens, self.items = gate, prompt_tokens, items
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._gate.queued_requests -= self.items
            self._gate.queued_tokens -= self.prompt_tokens


class AdmissionGate:
    """Caps the queued items (requests, or an encoder's inputs) and their tokens (0 = no cap); past a cap,
    a 429 `queue_full`.

    A request larger than a cap is still let in when nothing is queued, or it could never run.
    Event-loop thread only.
    """

    def __init__(self, max_requests: int = 0, max_tokens: int = 0, names: GateNames = GateNames()):
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.names = names
        self.queued_requests = 0
        self.queued_tokens = 0

    def admit(self, prompt_tokens: int, items: int = 1) -> Ticket:
        n = self.names
        if self.max_requests and self.queued_requests and self.queued_requests + items > self.max_requests:
            raise self._full(f"{self.queued_requests} {n.items} are already {n.state} "
                             f"({n.items_flag} {self.max_requests})")
        if self.max_tokens and self.queued_requests and self.queued_tokens + prompt_tokens > self.max_tokens:
            raise self._full(f"{self.queued_tokens} {n.tokens} are already {n.state} and this request adds "
                             f"{prompt_tokens} ({n.tokens_flag} {self.max_tokens})")
        self.queued_requests += items
        self.queued_tokens += prompt_tokens
        return Ticket(self, prompt_tokens, items)

    @staticmethod
    def _full(why: str) -> Refusal:
        return Refusal(f"the server is overloaded: {why}; retry later", status=429, code="queue_full",
                       headers={"Retry-After": str(RETRY_AFTER_S)})
