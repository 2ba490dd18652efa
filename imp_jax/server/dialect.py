"""One pipeline for every generation route: parse -> validate -> build the engine request -> run -> format.

A dialect (Chat, Completions, /infill, Messages, Responses) is a small adapter, made per request, that
supplies only what differs: its body model and checks (`body`, `validate`), its response id (`mint_id`), its
prompt (prompts.py) and sampling (`plan`), and its reply, streamed (`stream`: a StreamFormatter, whose
`error` frames are the dialect's error envelope mid-stream) and whole (`reply`). Everything else is here:
the RequestContext (context.engine_request), the engine request built once from it (generation_request),
admission and its record (lifecycle.begin), the SSE driver or the collected result, and the JSON reply.
An error before the reply starts is answered by app.py in the path's envelope (errors.error_body), as is
any error before a route runs (access, body limits, unknown routes).
"""
from __future__ import annotations

import abc
import dataclasses
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from imp_jax.runtime.request import EngineEvent, GenerationRequest, SamplingParams, check_context
from imp_jax.server import lifecycle
from imp_jax.server.context import RequestContext, default_max_tokens, engine_request
from imp_jax.server.generation import Completion, collect
from imp_jax.server.limits import json_reply
from imp_jax.server.streaming import StreamFormatter, drive, sse_response
from imp_jax.server.validation import WireModel


@dataclasses.dataclass
class Plan:
    """A dialect's engine request before it is built: the prompt, how to sample it, and the request's own fields."""

    ids: list[int]
    params: SamplingParams
    stream: bool = False
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)   # GenerationRequest's (priority, images, ...)


class Dialect(abc.ABC):
    """A dialect's adapter for one request: its parsed body (`req`, a `body`; subclasses annotate its type) and
    RequestContext (`ctx`)."""

    body: ClassVar[type[WireModel]]

    def __init__(self, req: Any, ctx: RequestContext):
        self.req, self.ctx, self.engine = req, ctx, ctx.engine

    @staticmethod
    @abc.abstractmethod
    def mint_id() -> str:
        """A fresh id for the response (and the engine request), in the dialect's spelling."""

    def keepalive_s(self) -> float | None:
        """The silence after which a stream sends the formatter's ping frame (None: no pings)."""
        return None

    def validate(self) -> None:
        """The body's cross-field rules, its `check()` (a 400 naming the field)."""
        self.req.check()

    @abc.abstractmethod
    async def plan(self) -> Plan:
        """The prompt (prompts.py), the sampling parameters and the engine request's fields."""

    @abc.abstractmethod
    def stream(self, plan: Plan) -> StreamFormatter:
        """The formatter of a streamed reply."""

    @abc.abstractmethod
    def reply(self, plan: Plan, result: Completion) -> dict[str, Any]:
        """The whole reply's JSON object (built off the event loop: limits.json_reply)."""

    def max_tokens(self, ids: list[int], asked: int | None, param: str) -> int | None:
        """`asked` (or --max-tokens) for a prompt of `ids`: a 400 naming `param` when they do not fit the context."""
        check_context(len(ids), asked, self.engine.max_model_len, param)
        return default_max_tokens(asked, len(ids), self.engine.max_model_len)

    def scheduling(self) -> dict[str, Any]:
        """The body's queue priority and cache_prompt pin, as the engine request's fields."""
        return {"priority": self.req.priority or 0, "cache_prompt": bool(self.req.cache_prompt)}


async def serve(dialect: type[Dialect]) -> Any:
    """A generation route's whole answer: the body parsed and checked, the engine request built and run,
    and its events formatted as `dialect` says, streamed or whole."""
    req, ctx = await engine_request(dialect.body, dialect.mint_id)
    adapter = dialect(req, ctx)
    adapter.validate()
    plan = await adapter.plan()
    greq, events = await run(ctx, plan)
    if plan.stream:
        return sse_response(drive(ctx.engine, greq.request_id, events, adapter.stream(plan),
                                  adapter.keepalive_s()))
    result = await collect(ctx.engine, greq, events)
    return await json_reply(adapter.reply, plan, result)


async def run(ctx: RequestContext, plan: Plan) -> tuple[GenerationRequest, AsyncIterator[EngineEvent]]:
    """The engine request `plan` describes, built once from `ctx`, admitted and started (lifecycle.begin)."""
    greq = ctx.generation_request(plan.ids, plan.params, **plan.fields)
    return greq, await lifecycle.begin(ctx.engine, greq, plan.stream)
