"""Per-tenant limits on generation: requests in flight, requests waiting for a first token, tokens a minute.

A tenant is an API key (by digest) or, on a server without keys, the client address: the caller the
rate limiter counts and the `tenant` the engine's fair scheduler shares steps between. Tokens a minute
are a token bucket per tenant (`--tokens-per-minute` in a burst, refilled at that rate): a request's
prompt tokens are charged when it is admitted and its generated tokens when it ends (all its choices),
so the bucket may run into debt; a tenant is refused while its bucket is empty or in debt, with the
seconds until it refills past zero as Retry-After. Event-loop thread only.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

from imp_jax.server.admission import AdmissionGate, Ticket
from imp_jax.server.errors import Refusal

MAX_TRACKED_TENANTS = 10_000   # tenants kept before idle ones (nothing in flight, bucket full) are dropped


@dataclasses.dataclass
class _Tenant:
    tokens: float       # the bucket: tokens left, negative in debt
    updated: float
    running: int = 0    # admitted and not ended
    queued: int = 0     # admitted, no first event yet


class TenantLimits:
    """`--max-concurrent-per-key`, `--max-queued-per-key`, `--tokens-per-minute` (0 = off); past one, a 429."""

    def __init__(self, max_concurrent: int = 0, max_queued: int = 0, tokens_per_minute: int = 0,
                 clock: Callable[[], float] = time.monotonic):
        self.max_concurrent, self.max_queued, self.tokens_per_minute = max_concurrent, max_queued, tokens_per_minute
        self._clock = clock
        self._tenants: dict[str, _Tenant] = {}

    def admit(self, tenant: str, prompt_tokens: int) -> TenantHold:
        """Count the request in (charging its prompt), or refuse it with the limit it met."""
        t = self._refilled(tenant)
        if self.max_concurrent and t.running >= self.max_concurrent:
            raise _refused(f"{t.running} requests of this caller are in flight (--max-concurrent-per-key "
                           f"{self.max_concurrent})", "concurrency_limit_exceeded", 1)
        if self.max_queued and t.queued >= self.max_queued:
            raise _refused(f"{t.queued} requests of this caller are waiting for their first token "
                           f"(--max-queued-per-key {self.max_queued})", "key_queue_full", 1)
        if self.tokens_per_minute and t.tokens <= 0:
            wait = (1 - t.tokens) / (self.tokens_per_minute / 60.0)
            raise _refused(f"this caller has spent its {self.tokens_per_minute} tokens per minute "
                           f"(--tokens-per-minute)", "tokens_per_minute_exceeded", wait)
        t.running += 1
        t.queued += 1
        self._charge(t, prompt_tokens)
        return TenantHold(self, tenant)

    def _charge(self, t: _Tenant, tokens: int) -> None:
        if self.tokens_per_minute:
            t.tokens -= tokens

    def _refilled(self, tenant: str) -> _Tenant:
        now = self._clock()
        t = self._tenants.get(tenant)
        if t is None:
            if len(self._tenants) >= MAX_TRACKED_TENANTS:
                self._forget_idle()
            t = self._tenants[tenant] = _Tenant(float(self.tokens_per_minute), now)
        t.tokens = min(float(self.tokens_per_minute), t.tokens + (now - t.updated) * self.tokens_per_minute / 60.0)
        t.updated = now
        return t

    def _forget_idle(self) -> None:
        """Drop tenants with nothing in flight whose bucket has refilled: forgetting them changes nothing."""
        for name in [n for n in self._tenants if self._idle(n)]:
            del self._tenants[name]

    def _idle(self, tenant: str) -> bool:
        t = self._refilled(tenant)
        return t.running == 0 and t.tokens >= self.tokens_per_minute

    def _started(self, tenant: str) -> None:
        self._tenants[tenant].queued -= 1

    def _ended(self, tenant: str, generated_tokens: int) -> None:
        t = self._refilled(tenant)
        t.running -= 1
        self._charge(t, generated_tokens)


class TenantHold:
    """One request's place in its tenant's counts: `started()` at its first event, `end()` when it ends
    (both idempotent; `end()` implies `started()`)."""

    def __init__(self, limits: TenantLimits, tenant: str):
        self._limits, self._tenant = limits, tenant
        self._queued = self._running = True

    def started(self) -> None:
        if self._queued:
            self._queued = False
            self._limits._started(self._tenant)

    def end(self, generated_tokens: int) -> None:
        self.started()
        if self._running:
            self._running = False
            self._limits._ended(self._tenant, generated_tokens)


def admit_both(gate: AdmissionGate, limits: TenantLimits, tenant: str, tokens: int,
               items: int = 1) -> tuple[Ticket, TenantHold]:
    """A place in `gate`'s queue and in `tenant`'s counts, or a 429 from either, holding neither."""
    ticket = gate.admit(tokens, items=items)
    try:
        return ticket, limits.admit(tenant, tokens)
    except BaseException:
        ticket.release()
        raise


def _refused(why: str, code: str, wait_s: float) -> Refusal:
    retry = max(1, math.ceil(wait_s))
    return Refusal(f"{why}; retry after {retry} s", status=429, code=code, headers={"Retry-After": str(retry)})
