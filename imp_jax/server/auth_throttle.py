"""Failed API-key attempts per client address: past `--auth-failures-per-minute` in the last minute, the
address gets 429 before its key is checked.

Without it a client may guess keys as fast as the server answers 401s (the rate limiter counts callers
by key, so a wrong key never meets it). A throttled address is refused whatever key it sends, a valid
one too: were a right guess let through, the 429 itself would tell it from a wrong one. Only a key that
was sent and refused counts; a request without a key is not a guess. Event-loop thread only.
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from imp_jax.server.errors import Refusal

WINDOW_S = 60.0
MAX_TRACKED_ADDRESSES = 10_000   # past it, the address whose last failure is oldest is forgotten


class AuthThrottle:
    """A sliding minute of failure times per client address; `per_minute` 0 = off."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic):
        self.per_minute = per_minute
        self._clock = clock
        self._failures: OrderedDict[str | None, deque[float]] = OrderedDict()

    def check(self, client_addr: str | None, failed: bool) -> None:
        """429 if the address spent its failures this minute; else count this attempt when `failed`."""
        if not self.per_minute:
            return
        now = self._clock()
        times = self._recent(client_addr, now)
        if len(times) >= self.per_minute:
            retry = max(1, math.ceil(times[0] + WINDOW_S - now))
            raise Refusal(f"too many failed API-key attempts from this address ({self.per_minute} a minute, "
                          f"--auth-failures-per-minute); retry after {retry} s", status=429,
                          code="auth_failures_exceeded", headers={"Retry-After": str(retry)})
        if failed:
            self._failures.setdefault(client_addr, times).append(now)
            self._failures.move_to_end(client_addr)
            if len(self._failures) > MAX_TRACKED_ADDRESSES:
                self._failures.popitem(last=False)

    def _recent(self, client_addr: str | None, now: float) -> deque[float]:
        """The address's failures within the window (older ones dropped; an address left with none, forgotten)."""
        times = self._failures.get(client_addr, deque())
        while times and times[0] <= now - WINDOW_S:
            times.popleft()
        if not times:
            self._failures.pop(client_addr, None)
        return times
