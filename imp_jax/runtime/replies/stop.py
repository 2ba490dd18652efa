"""Stop strings over streamed text: hold back any tail that could still grow into a stop string."""
from __future__ import annotations

from typing import Sequence


class StopStringMatcher:
    """Feed text deltas; get back what is safe to emit and whether a stop string matched.

    Text that might be the start of a stop string is held back until it cannot match,
    so a stop string is never emitted (unless `include_stop` asks for it).
    """

    def __init__(self, stops: Sequence[str], include_stop: bool = False):
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        self._held = ""
        self._max_len = max((len(s) for s in self.stops), default=0)

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Return (text safe to emit, the stop string that matched or None)."""
        if not self.stops:
            return delta, None
        buf = self._held + delta
        hit = min(((buf.find(s), s) for s in self.stops if s in buf), default=None)
        if hit is not None:
            at, stop = hit
            self._held = ""
            return buf[:at] + (stop if self.include_stop else ""), stop
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], None

    def flush(self) -> str:
        """The held-back text, at the end of a sequence that stopped for another reason."""
        out, self._held = self._held, ""
        return out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        for n in range(min(len(buf), self._max_len - 1), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
