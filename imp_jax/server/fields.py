"""Nothing silently ignored: each generation route's body fields are honoured or refused with a 400 naming them.

A route's request model declares what it honours: its pydantic fields, less `REFUSED` (inherited fields
it cannot honour, each with a hint), plus `EXTRAS` (body keys it reads outside the model, such as
`session_id`). Every field that some generation route honours is a *known* field (`known_fields`);
sent to a route that does not honour it, with a value that asks for something (not null, false, 0, "",
[] or {}), it is a 400 `not_supported` naming it. A key no route knows is ignored, as vLLM and llama.cpp
ignore them (clients send vendor extras); docs/API.md ("Fields each route takes") lists the tables.
"""
from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel

from imp_jax.errors import InvalidRequestError

# Body keys every generation route reads outside its model (context.engine_request: its RequestContext).
# (NOT_YET and CHAT_ONLY fields are refused by validation.refuse_not_yet.)
ENGINE_EXTRAS = frozenset({"session_id", "lora", "speculative"})
SAMPLING_EXTRAS = ENGINE_EXTRAS | {"banned_strings", "banned_regex"}   # OpenAISampling.banned

STRUCTURED = ("response_format", "guided_json", "guided_regex", "guided_grammar", "guided_choice",
              "structured_outputs", "grammar", "json_schema")
LOGPROBS = ("logprobs", "top_logprobs", "prompt_logprobs", "echo")


def honoured(cls: type[BaseModel]) -> frozenset[str]:
    """The body fields `cls`'s route honours."""
    refused = getattr(cls, "REFUSED", {})
    return frozenset(n for n in cls.model_fields if n not in refused) | getattr(cls, "EXTRAS", frozenset())


@functools.cache
def route_models() -> dict[str, type[BaseModel]]:
    """Each generation route and its request model (imported here: the routes import this module's users)."""
    from imp_jax.server.anthropic_messages import MessagesRequest
    from imp_jax.server.chat_completions import ChatRequest
    from imp_jax.server.completions import CompletionRequest
    from imp_jax.server.infill import InfillRequest
    from imp_jax.server.responses import ResponsesRequest
    from imp_jax.server.scoring import DecideRequest, ScoreRequest

    return {"/v1/chat/completions": ChatRequest, "/v1/completions": CompletionRequest,
            "/v1/messages": MessagesRequest, "/v1/responses": ResponsesRequest, "/infill": InfillRequest,
            "/v1/score": ScoreRequest, "/v1/decide": DecideRequest}


@functools.cache
def known_fields() -> frozenset[str]:
    """Every body field some generation route honours."""
    return frozenset().union(*(honoured(cls) for cls in route_models().values()))


NEUTRAL = {"n": 1, "best_of": 1, "cfg_scale": 1}   # besides asks_nothing's: values that ask nothing of these fields


def asks_nothing(value: Any) -> bool:
    """null, false, 0, "", [] and {}: a value that asks for nothing (clients send such defaults)."""
    if isinstance(value, BaseModel):
        return all(asks_nothing(v) for v in value.model_dump().values())
    return value is None or value is False or (type(value) in (int, float) and value == 0) or value in ("", [], {})


def check_fields(req: BaseModel, route: str) -> None:
    """400 not_supported for a known field this route does not honour (its REFUSED, or another route's)."""
    cls = type(req)
    if not hasattr(cls, "EXTRAS"):
        return
    refused: dict[str, str] = getattr(cls, "REFUSED", {})
    sent = {n: getattr(req, n) for n in req.model_fields_set if n in refused}
    extras = getattr(cls, "EXTRAS")
    sent.update((n, v) for n, v in (req.model_extra or {}).items() if n not in extras and n in known_fields())
    for name, value in sent.items():
        if asks_nothing(value) or (name in NEUTRAL and type(value) in (int, float) and value == NEUTRAL[name]):
            continue
        hint = refused.get(name) or getattr(cls, "HINTS", {}).get(name, "")
        raise InvalidRequestError(f"'{name}' is not supported on {route}{'; ' + hint if hint else ''}",
                                  code="not_supported", param=name)
