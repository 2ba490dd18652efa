"""The one per-token SSE driver every dialect streams through.

A dialect supplies a StreamFormatter (engine events -> SSE frames); the driver owns the
rest: keepalives, the end of the stream, an error frame on any fault (never a silent cut),
and cancelling the request when the client goes away (Quart cancels the body generator).
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

from quart import Response

from imp_jax.errors import EngineError, ImpError
from imp_jax.runtime.api import Engine
from imp_jax.runtime.request import EngineEvent, Usage
from imp_jax.server.errors import to_imp_error
from imp_jax.server.generation import close_events, event_error, public_error

log = logging.getLogger("imp_jax.server")


class StreamFormatter(Protocol):
    """A dialect's streaming shape. Each method returns the SSE frames to send (possibly none)."""

    def open(self) -> list[str]: ...
    def event(self, ev: EngineEvent) -> list[str]: ...
    def close(self, usage: Usage | None) -> list[str]: ...
    def error(self, err: ImpError) -> list[str]: ...
    def ping(self) -> list[str]: ...


def sse(data: Any, event: str | None = None) -> str:
    """One SSE frame; `data` is sent as JSON unless it is already a string."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n"


def sse_response(body: AsyncIterator[str], headers: dict[str, str] | None = None) -> Response:
    """A streaming text/event-stream response with no response timeout."""
    response = Response(body, status=200, content_type="text/event-stream; charset=utf-8",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
    response.timeout = None
    return response


async def drive(engine: Engine, request_id: str, events: AsyncIterator[EngineEvent], fmt: StreamFormatter,
                keepalive_s: float | None = None) -> AsyncIterator[str]:
    """Format `events` into SSE frames until the request's last event, an error, or the client leaves."""
    finished = False
    try:
        for frame in fmt.open():
            yield frame
        while True:
            ev = None
            async for item in _next_or_pings(events, keepalive_s):
                if item is None:
                    for frame in fmt.ping():
                        yield frame
                else:
                    ev = item
            if ev is None:
                raise EngineError("the engine ended the stream without finishing the request")
            err = event_error(ev)
            if err is not None:
                finished = True
                for frame in fmt.error(err):
                    yield frame
                return
            for frame in fmt.event(ev):
                yield frame
            if ev.done:
                finished = True
                for frame in fmt.close(ev.usage):
                    yield frame
                return
    except asyncio.CancelledError:
        log.info("client left the stream of %s; request cancelled", request_id)
        raise
    except Exception as e:  # a fault mid-stream: end with the dialect's error event
        err = public_error(to_imp_error(e))
        if err.status >= 500:
            log.exception("stream %s failed", request_id)
        for frame in fmt.error(err):
            yield frame
    finally:
        if not finished:
            engine.cancel(request_id)
        await close_events(events)


async def _next_or_pings(events: AsyncIterator[EngineEvent], keepalive_s: float | None
                         ) -> AsyncIterator[EngineEvent | None]:
    """Yield None per keepalive period spent waiting, then the next event; nothing when the events end."""
    if keepalive_s is None:
        try:
            yield await anext(events)
        except StopAsyncIteration:
            pass
        return
    task = asyncio.ensure_future(anext(events))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=keepalive_s)
            if done:
                break
            yield None
        try:
            yield task.result()
        except StopAsyncIteration:
            pass
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
