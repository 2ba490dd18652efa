"""The queue in front of the engine, as the server counts it: admitted generation requests without a first event.

A request joins when it is submitted and leaves when its first event arrives (its prompt is
prefilled, it was refused, or it ended) or it is abandoned. Counting on the server, at submit
time, is what makes the caps hold under a burst: the engine thread learns of a request only
when it drains its inbox, after the whole burst has been let in.
"""
from __future__ import annotations

from imp_jax.server.errors import Refusal

RETRY_AFTER_S = 1


class Ticket:
    """One request's place in the queue; `release()` (idempotent) gives it back."""

    def __init__(self, gate: AdmissionGate, prompt_tokens: int):
        self._gate, self.prompt_tokens = gate, prompt_tokens
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._gate.queued_requests -= 1
            self._gate.queued_tokens -= self.prompt_tokens


class AdmissionGate:
    """Caps the queued requests and their prompt tokens (0 = no cap); past a cap, a 429 `queue_full`.

    A prompt larger than the token cap is still let in when nothing is queued, or it could never run.
    Event-loop thread only.
    """

    def __init__(self, max_requests: int = 0, max_tokens: int = 0):
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.queued_requests = 0
        self.queued_tokens = 0

    def admit(self, prompt_tokens: int) -> Ticket:
        if self.max_requests and self.queued_requests >= self.max_requests:
            raise self._full(f"{self.queued_requests} requests are already waiting for their first token "
                             f"(--max-queued-requests {self.max_requests})")
        if self.max_tokens and self.queued_requests and self.queued_tokens + prompt_tokens > self.max_tokens:
            raise self._full(f"{self.queued_tokens} prompt tokens are already waiting and this request adds "
                             f"{prompt_tokens} (--max-queued-tokens {self.max_tokens})")
        self.queued_requests += 1
        self.queued_tokens += prompt_tokens
        return Ticket(self, prompt_tokens)

    @staticmethod
    def _full(why: str) -> Refusal:
        return Refusal(f"the server is overloaded: {why}; retry later", status=429, code="queue_full",
                       headers={"Retry-After": str(RETRY_AFTER_S)})
