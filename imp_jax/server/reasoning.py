"""Reasoning on the wire: what reaches the chat template, Anthropic's `thinking` opt-in, the
reasoning parts of the dialects' replies, and `POST /v1/requests/{id}/end_thinking`.

The engine splits a thinking model's think block (runtime/replies/reasoning.py), or a harmony reply's analysis
channel (runtime/replies/harmony.py, gpt-oss), from its answer into each event's `reasoning_text` and `text`; the
dialects only place the two. Whether the model thinks at all is the engine's model fact (`Engine.thinks`).
"""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
from typing import Any

from quart import Blueprint, jsonify

from imp_jax.errors import ImpError, InvalidRequestError, NotFoundError
from imp_jax.server.context import caller_owner, ready_engine, server
from imp_jax.server.errors import not_supported

bp = Blueprint("reasoning", __name__)
END_THINKING_TIMEOUT_S = 10.0
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def template_kwargs(kwargs: dict[str, Any] | None, enable_thinking: bool | None = None,
                    reasoning_effort: Any = None, effort_param: str = "reasoning_effort") -> dict[str, Any]:
    """The chat template's extra variables: the request's chat_template_kwargs, then its reasoning fields
    (effort "none" also means enable_thinking: false, unless the request says otherwise)."""
    out = dict(kwargs or {})
    if reasoning_effort is not None:
        if reasoning_effort not in REASONING_EFFORTS:
            raise InvalidRequestError(f"'{effort_param}' must be one of {', '.join(REASONING_EFFORTS)}",
                                      param=effort_param)
        out["reasoning_effort"] = reasoning_effort
        if reasoning_effort == "none":
            out.setdefault("enable_thinking", False)
    if enable_thinking is not None:
        out["enable_thinking"] = enable_thinking
    return out


# ------------------------------------------------------------------------------------------ Anthropic
@dataclasses.dataclass(frozen=True)
class Thinking:
    """Anthropic's `thinking` opt-in: whether thinking blocks are returned, shown, and capped."""

    enabled: bool = False
    budget_tokens: int | None = None
    display: str = "summarized"   # "omitted": the block's text is left out, its signature kept


def anthropic_thinking(cfg: dict[str, Any] | None) -> Thinking:
    """Parse `thinking` ({"type": "enabled", "budget_tokens": N} | "adaptive" | "between_tools" | "disabled");
    a 400 names the field. "between_tools" thinks like "adaptive" (this server runs no tool loop of its own)."""
    if cfg is None:
        return Thinking()
    kind = cfg.get("type")
    if kind == "disabled":
        return Thinking()
    if kind not in ("enabled", "adaptive", "between_tools"):
        raise not_supported(f"'thinking.type' {kind!r} is not supported; use 'enabled', 'adaptive', "
                            "'between_tools' or 'disabled'",
                            param="thinking.type")
    display = cfg.get("display") or "summarized"
    if display not in ("summarized", "omitted"):
        raise InvalidRequestError("'thinking.display' must be 'summarized' or 'omitted'", param="thinking.display")
    budget = cfg.get("budget_tokens")
    if kind == "enabled" and (type(budget) is not int or budget < 1):
        raise InvalidRequestError("'thinking.budget_tokens' must be an integer >= 1", param="thinking.budget_tokens")
    return Thinking(True, budget if kind == "enabled" else None, display)


def signature(text: str) -> str:
    """A thinking block's signature: opaque to clients, a digest of the text (not a proof of origin)."""
    return base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()


def thinking_block(text: str, thinking: Thinking) -> dict[str, Any]:
    shown = text if thinking.display != "omitted" else ""
    return {"type": "thinking", "thinking": shown, "signature": signature(text)}


# ------------------------------------------------------------------------------------------ Responses
def reasoning_item(item_id: str, text: str | None, status: str, encrypted: bool = False) -> dict[str, Any]:
    """A Responses `reasoning` output item; `text` None: no content part yet. With `encrypted` (`include`:
    reasoning.encrypted_content) the item carries `encrypted_content` for a stateless client to replay: the
    text in base64, not encrypted (this server drops replayed reasoning, as thinking templates do)."""
    opaque = base64.b64encode(text.encode()).decode() if encrypted and text else None
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status, "encrypted_content": opaque,
            "content": [] if text is None else [reasoning_part(text)]}


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


# ------------------------------------------------------------------------------------------ end_thinking
@bp.post("/v1/requests/<request_id>/end_thinking")
async def end_thinking(request_id: str) -> Any:
    """End a pending or running request's think block; the answer continues on the same KV."""
    engine = ready_engine()
    if not engine.capabilities.end_thinking:
        raise not_supported("this engine cannot end a think block", param="id")
    engine_id = server().engine_id(request_id, caller_owner())
    try:
        status = "unknown" if engine_id is None else \
            await asyncio.wait_for(engine.end_thinking(engine_id), END_THINKING_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise ImpError("the engine did not answer in time", code="engine_busy", status=503) from None
    if status == "unknown":
        raise NotFoundError(f"no pending or running request with id '{request_id}'", code="request_not_found",
                            param="id")
    if status == "not_thinking":
        raise ImpError(f"request '{request_id}' is not a thinking request (the model or its reply has no think "
                       "block)", code="not_thinking", status=409, param="id")
    return jsonify({"id": request_id, "status": status})
