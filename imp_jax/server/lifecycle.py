"""A generation request's life on the server: queue admission, the request timeout, its events observed to the end.

Every dialect starts generation through `begin()`. The request holds a place in the
AdmissionGate until its first event, and one in its tenant's counts (tenants.py) until it ends; `--request-timeout` cancels it in the engine and the
answer ends normally with what it has (the engine's `cancelled` becomes `length`); each event
feeds the request's record, and when the events end (done, error, client gone, client
dropped) the record is handed to telemetry.
"""
from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import AsyncIterator

from quart import g, request

from imp_jax.errors import ImpError
from imp_jax.runtime.api import Engine
from imp_jax.runtime.request import EngineEvent, GenerationRequest
from imp_jax.server.context import server
from imp_jax.server.generation import close_events, event_error, start
from imp_jax.server.metrics import ENDPOINTS
from imp_jax.server.request_record import RequestRecord
from imp_jax.server.telemetry import Telemetry
from imp_jax.server.tenants import TenantHold, admit_both

log = logging.getLogger("imp_jax.server")


async def begin(engine: Engine, req: GenerationRequest, stream: bool) -> AsyncIterator[EngineEvent]:
    """Admit `req` (429 past the queue caps or its tenant's limits), submit it and wait for its first event; its events, observed.

    `req` comes whole from RequestContext.generation_request (its session, adapter, tenant already set); the
    record it feeds is the one app.py's hooks opened and report (g.record).
    An ImpError the engine raises for the request (a 4xx) means it never ran: nothing is traced or counted.
    """
    state = server()
    rec: RequestRecord = g.record
    rec.endpoint, rec.model, rec.stream = ENDPOINTS.get(request.path), engine.served_name, stream
    rec.prompt_tokens = len(req.prompt_ids)
    ticket, hold = admit_both(state.gate, state.tenants, req.tenant, len(req.prompt_ids))
    tracked = TrackedEvents(engine, req.request_id, rec, state.telemetry, state.config.request_timeout, hold)
    rec.submitted_at = time.monotonic()
    rec.generating = rec.generated = True
    try:
        events = await start(engine, req, state.config.stream_limits, rec.mark_stalled)
    except ImpError as e:
        if e.status < 500:  # refused by the engine: not a generation
            rec.generated = False
        tracked.end(error=e)
        raise
    except BaseException as e:
        tracked.end(error=e)
        raise
    finally:
        ticket.release()
        hold.started()
    tracked.attach(events)
    return tracked


class TrackedEvents:
    """The request's events as the dialect reads them (an async iterator), observed on the way through.

    A class, not a generator, so that its end always runs: on the last event, on `aclose()`,
    or when it is dropped unread (a stream whose body never started). Nothing it holds refers
    back to it (the stall callback is the record's), so dropping it ends it at once, on the loop.
    """

    def __init__(self, engine: Engine, request_id: str, rec: RequestRecord, telemetry: Telemetry,
                 timeout_s: float, hold: TenantHold):
        self._engine, self._request_id, self._rec, self._telemetry = engine, request_id, rec, telemetry
        self._hold = hold   # its tenant's counts (tenants.py): generated tokens are charged at the end
        self._events: AsyncIterator[EngineEvent] | None = None
        self._done = self._failed = self._ended = False
        self._timer: asyncio.TimerHandle | None = None
        if timeout_s > 0:
            remaining = max(0.0, rec.arrival + timeout_s - time.monotonic())
            time_out = weakref.WeakMethod(self._time_out)  # a pending timer must not keep it alive
            self._timer = asyncio.get_running_loop().call_later(
                remaining, lambda: (fn := time_out()) is not None and fn())

    def attach(self, events: AsyncIterator[EngineEvent]) -> None:
        self._events = events

    def _time_out(self) -> None:
        self._timer = None
        if not self._ended:
            log.info("request %s reached --request-timeout; ending it with what it has", self._request_id)
            self._rec.timed_out = True
            self._engine.cancel(self._request_id)

    def __aiter__(self) -> TrackedEvents:
        return self

    async def __anext__(self) -> EngineEvent:
        if self._events is None or self._ended:
            raise StopAsyncIteration
        try:
            ev = await anext(self._events)
        except StopAsyncIteration:
            self.end()
            raise
        except BaseException as e:
            self.end(error=e)
            raise
        if self._rec.timed_out and ev.finish_reason == "cancelled":
            ev.finish_reason = "length"
        gaps = self._rec.see(ev)
        if gaps and self._rec.endpoint is not None:
            self._telemetry.metrics.observe_gaps(self._rec.endpoint, gaps)
        self._failed |= event_error(ev) is not None
        if ev.done:
            self._done = True
            self.end()
        return ev

    async def aclose(self) -> None:
        self.end()
        if self._events is not None:
            await close_events(self._events)

    def __del__(self) -> None:
        self.end()

    def end(self, error: BaseException | None = None) -> None:
        """Once: stop the timer, cancel the request if it is still running, and report the record."""
        if self._ended:
            return
        self._ended = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._done:
            self._engine.cancel(self._request_id)
        rec = self._rec
        self._hold.end(rec.completion_tokens)
        failed = self._failed or (isinstance(error, Exception) and not isinstance(error, asyncio.CancelledError))
        if rec.stalled:
            outcome = "dropped"
        elif rec.timed_out:
            outcome = "timed_out"
        elif failed:
            outcome = "error"
            rec.error_message = rec.error_message or (str(error) if error is not None else None)
        else:
            outcome = "ok" if self._done else "cancelled"
        rec.end_generation(outcome)
        self._telemetry.report_if_complete(rec)
