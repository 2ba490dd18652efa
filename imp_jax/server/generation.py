"""Running a GenerationRequest on the engine: start it (errors before the first event), or collect it whole."""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from imp_jax.errors import EngineError, ImpError, InvalidRequestError
from imp_jax.runtime.api import Engine
from imp_jax.runtime.replies.calls import ParseEvent
from imp_jax.runtime.request import EngineEvent, GenerationRequest, StreamLimits, TokenLogprob, Usage

log = logging.getLogger("imp_jax.server")
# What a client is told of a device fault; the exception's own text goes to the server log only.
ENGINE_FAULT_MESSAGE = "the engine faulted while generating; restart the server (the server log says why)"
_INTERNAL_MARKS = ("device fault", "engine failed to start", "engine is faulted:")


async def start(engine: Engine, req: GenerationRequest, limits: StreamLimits = StreamLimits(),
                on_stall: Callable[[], None] | None = None) -> AsyncIterator[EngineEvent]:
    """Submit `req` and wait for its first event, so a rejection surfaces here as an ImpError (a 4xx).

    Returns an iterator over every event, the first included. If the wait is interrupted
    (client gone), the request is cancelled. `limits` and `on_stall`: see AsyncEngine.generate.
    """
    events = aiter(engine.generate(req, limits, on_stall))
    try:
        first = await anext(events)
    except StopAsyncIteration:
        raise EngineError("the engine ended the request without any event") from None
    except BaseException:
        engine.cancel(req.request_id)
        await close_events(events)
        raise
    return _prepend(first, events)


async def _prepend(first: EngineEvent, rest: AsyncIterator[EngineEvent]) -> AsyncIterator[EngineEvent]:
    try:
        yield first
        async for ev in rest:
            yield ev
    finally:
        await close_events(rest)


async def close_events(events: AsyncIterator[EngineEvent]) -> None:
    if isinstance(events, AsyncGenerator):   # a plain async iterator has nothing to close
        await events.aclose()


def event_error(ev: EngineEvent) -> ImpError | None:
    """The error an engine event reports (a fault mid-request), or None."""
    if ev.error is None and ev.finish_reason != "error":
        return None
    extra = ev.extra or {}
    if "param" in extra:   # the request's own input ended it (banned_regex's time budget): a 400 naming it
        return InvalidRequestError(ev.error or "invalid request", code=extra.get("code"), param=extra["param"])
    code = extra.get("code", "engine_faulted")  # the engine reports device faults this way
    message = public_engine_message(ev.error or "the engine failed while generating")
    if message != ev.error:
        log.error("request %s failed in the engine: %s", ev.request_id, ev.error)
    return EngineError(message, code=code)


def public_error(err: ImpError) -> ImpError:
    """`err` as a client may see it: an engine fault's internal text replaced (and logged)."""
    if isinstance(err, EngineError) and public_engine_message(err.message) != err.message:
        log.error("engine error: %s", err.message)
        return EngineError(public_engine_message(err.message), code=err.code, status=err.status)
    return err


def public_engine_message(message: str) -> str:
    """What a client is told of an engine error: a fault's text is an internal exception's (the AsyncEngine
    prefixes it), so it goes to the log and the client gets ENGINE_FAULT_MESSAGE."""
    if any(mark in message for mark in _INTERNAL_MARKS):
        return ENGINE_FAULT_MESSAGE
    return message


@dataclasses.dataclass
class Choice:
    """One finished sequence (of n) of a non-streamed request."""

    index: int
    text: str = ""
    reasoning: str = ""   # the think block's text (GenerationRequest.reasoning)
    answer: list[ParseEvent] | None = None   # the answer's text and calls as the engine read them (EngineEvent.answer)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    raw_logprobs: dict[int, float] = dataclasses.field(default_factory=dict)   # at the first token (scoring.py)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclasses.dataclass
class Completion:
    """A whole non-streamed result: the choices in index order, and usage."""

    choices: list[Choice]
    usage: Usage
    prompt_logprobs: list[TokenLogprob | None] | None = None


async def collect(engine: Engine, req: GenerationRequest, events: AsyncIterator[EngineEvent]) -> Completion:
    """Drain `events` into a Completion; an engine fault raises, an interruption cancels the request."""
    choices = {i: Choice(i) for i in range(req.params.n)}
    usage: Usage | None = None
    prompt_logprobs = None
    done = False
    try:
        async for ev in events:
            err = event_error(ev)
            if err is not None:
                raise err
            c = choices.setdefault(ev.index, Choice(ev.index))
            c.text += ev.text
            c.reasoning += ev.reasoning_text
            if ev.answer is not None:
                c.answer = c.answer if c.answer is not None else []
                c.answer.extend(ev.answer)
            c.token_ids.extend(ev.token_ids)
            if ev.logprobs:
                c.logprobs.extend(ev.logprobs)
            if ev.raw_logprobs and not c.raw_logprobs:
                c.raw_logprobs = dict(ev.raw_logprobs)
            if ev.prompt_logprobs is not None:
                prompt_logprobs = ev.prompt_logprobs
            if ev.finish_reason is not None:
                c.finish_reason, c.stop_reason = ev.finish_reason, ev.stop_reason
            if ev.usage is not None:
                usage = ev.usage
            if ev.done:
                done = True
                break
    finally:
        if not done:
            engine.cancel(req.request_id)
        await close_events(events)
    if usage is None:
        raise EngineError("the engine ended the request without usage")
    return Completion([choices[i] for i in sorted(choices)], usage, prompt_logprobs)
