"""EventBuffer: one request's events on their way from the engine thread to its asyncio reader.

The engine thread never waits for a reader: `put` runs on the event loop (via
`call_soon_threadsafe`) and never blocks. The buffer is bounded: once it holds `max_events`,
an event merges into the newest buffered event of its choice instead of adding one, so a
slow reader costs at most its answer's text, not an event per token. (The request's last
event merges only into the newest event of all, so it stays last; it may be one past the bound.)
A reader that takes nothing for `stall_timeout_s` while events wait is stalled: `on_stall`
runs once and the buffer drops what it holds and everything after.
"""
from __future__ import annotations

import asyncio
import collections
from typing import Callable

from imp_jax.errors import EngineError
from imp_jax.runtime.replies.calls import merge_parts
from imp_jax.runtime.request import EngineEvent, StreamLimits

Item = EngineEvent | BaseException


def _mergeable(tail: Item, ev: Item) -> bool:
    """`ev` can be folded into `tail`: two plain token events of one choice."""
    return (isinstance(tail, EngineEvent) and isinstance(ev, EngineEvent) and tail.index == ev.index
            and tail.finish_reason is None and tail.error is None and not tail.done
            and ev.error is None and ev.prompt_logprobs is None)


def merge(tail: EngineEvent, ev: EngineEvent) -> None:
    """Fold `ev` into `tail` in place: tokens, text, reasoning text, answer parts and logprobs appended; the end, if
    any, taken over."""
    tail.token_ids = tail.token_ids + ev.token_ids
    tail.text += ev.text
    tail.reasoning_text += ev.reasoning_text
    if ev.answer is not None:   # (joined as the parser joins its own: one text or arguments delta, not two)
        tail.answer = merge_parts((tail.answer or []) + ev.answer)
    if ev.logprobs is not None:
        tail.logprobs = (tail.logprobs or []) + ev.logprobs
    tail.finish_reason, tail.stop_reason = ev.finish_reason, ev.stop_reason
    tail.usage, tail.done = ev.usage, ev.done
    tail.extra = {**tail.extra, **ev.extra}
    tail.created_at = ev.created_at
    if tail.admitted_at is None:
        tail.admitted_at = ev.admitted_at


class EventBuffer:
    """Bounded FIFO of a request's events (or the exception that rejected it), read by one coroutine."""

    def __init__(self, limits: StreamLimits, on_stall: Callable[[], None]):
        self.limits = limits
        self.stalled = False
        self.closed = False
        self._on_stall = on_stall
        self._items: collections.deque[Item] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._stall_timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: Item) -> None:
        """Add an item (event-loop thread only); never blocks. Dropped once the reader stalled or closed."""
        if self.stalled or self.closed:
            return
        target = self._merge_target(item) if len(self._items) >= self.limits.max_events else None
        if target is not None:
            merge(target, item)  # type: ignore[arg-type]
        else:
            self._items.append(item)
        if self._stall_timer is None:
            self._arm()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _merge_target(self, item: Item) -> EngineEvent | None:
        """The newest buffered event of the item's choice, if the item may fold into it."""
        if not isinstance(item, EngineEvent):
            return None
        for pos, queued in enumerate(reversed(self._items)):
            if isinstance(queued, EngineEvent) and queued.index == item.index:
                if (pos == 0 or not item.done) and _mergeable(queued, item):
                    return queued
                return None
        return None

    async def get(self) -> Item:
        """The oldest item, waiting for one if need be; raises once the reader was dropped as stalled."""
        while not self._items:
            if self.stalled:
                raise EngineError("the client stopped reading its stream; the request was dropped",
                                  code="client_stalled", status=408)
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        self._disarm()
        if self._items:  # the reader took one: what is left gets a fresh stall timeout
            self._arm()
        return item

    def close(self) -> None:
        """The reader is done: drop the timer, whatever is left and whatever comes later (the events a
        cancelled request still makes before the engine thread sees the cancellation)."""
        self.closed = True
        self._disarm()
        self._items.clear()

    def _arm(self) -> None:
        self._stall_timer = asyncio.get_running_loop().call_later(self.limits.stall_timeout_s, self._stall)

    def _disarm(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _stall(self) -> None:
        self._stall_timer = None
        self.stalled = True
        self._items.clear()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        self._on_stall()
