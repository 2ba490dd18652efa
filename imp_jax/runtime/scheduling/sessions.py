"""Agent sessions: a request with a `session_id` leaves its conversation's KV blocks pinned in the
prefix cache when it ends, so the session's next turn (the same prefix plus the new messages) finds
them even under pressure from other traffic. The pins last until the next turn of the session
replaces them, the session is closed, or it has been idle for the TTL. Sessions together may pin at
most `max_blocks` (the least recently used go first), so they can never starve admission.
"""
from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from typing import Callable

from imp_jax.runtime.kv.kv_blocks import BlockTable, KVBlockPool


@dataclasses.dataclass
class _Session:
    blocks: list[int]
    expires_at: float


class SessionPins:
    """session_id -> the pinned blocks of its last turn (engine thread only)."""

    def __init__(self, pool: KVBlockPool, ttl_s: float, max_blocks: int,
                 clock: Callable[[], float] = time.monotonic):
        self._pool, self._ttl, self._max_blocks, self._clock = pool, ttl_s, max_blocks, clock
        self._sessions: OrderedDict[str, _Session] = OrderedDict()   # least recently kept first
        self.num_blocks = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def keep(self, session_id: str, table: BlockTable) -> None:
        """Pin the committed blocks of `table` (a turn that just ended) for the session's next turn,
        in place of what its previous turn pinned (pinned first, so shared blocks stay cached)."""
        view = dataclasses.replace(table, pinned_ids=[])
        self._pool.pin(view)
        self._drop(session_id)
        self._sessions[session_id] = _Session(view.pinned_ids, self._clock() + self._ttl)
        self.num_blocks += len(view.pinned_ids)
        while self.num_blocks > self._max_blocks and len(self._sessions) > 1:
            self._drop(next(iter(self._sessions)))

    def close(self, session_id: str) -> bool:
        """Release a session's pins; whether it was open."""
        return self._drop(session_id)

    def expire(self) -> int:
        """Release the sessions idle past the TTL; how many. Sessions are kept in the order of their last
        turn, so of their expiry: the scan stops at the first one still live (cheap on every step)."""
        now, dropped = self._clock(), 0
        while self._sessions and next(iter(self._sessions.values())).expires_at <= now:
            self._drop(next(iter(self._sessions)))
            dropped += 1
        return dropped

    def _drop(self, session_id: str) -> bool:
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        self._pool.unpin_blocks(session.blocks)
        self.num_blocks -= len(session.blocks)
        return True
