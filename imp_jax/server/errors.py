"""Every error the server answers with, as an ImpError, and its two wire envelopes (OpenAI, Anthropic).

Dialects raise ImpError (or let pydantic / werkzeug raise theirs); `to_imp_error` normalises
them and `error_body` picks the envelope by path: `/v1/messages*` speaks Anthropic, the rest OpenAI.
"""
from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError
from werkzeug.exceptions import HTTPException

from imp_jax.errors import ImpError, InvalidRequestError

log = logging.getLogger("imp_jax.server")

_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 429: "rate_limit_error"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                    504: "timeout_error", 529: "overloaded_error"}
_ANTHROPIC_CODE_TYPES = {"queue_full": "overloaded_error"}  # a 429 Anthropic spells as overload, not a rate limit
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large",
               415: "unsupported_media_type", 408: "request_timeout"}


class Refusal(ImpError):
    """A request turned away before any work (401, 413, 429), with the headers that say why or when to retry."""

    def __init__(self, message: str, *, status: int, code: str, headers: dict[str, str] | None = None):
        super().__init__(message, code=code, status=status)
        self.headers = dict(headers or {})


RETRY_AFTER_S = {"loading": 5, "swapping": 5}   # the 503s that pass by themselves, and when to look again


def unavailable(message: str, code: str) -> ImpError:
    """A 503: the server cannot take requests right now (loading, swapping, suspended, draining, no model);
    with Retry-After where the state passes by itself."""
    retry = RETRY_AFTER_S.get(code)
    headers = {"Retry-After": str(retry)} if retry else None
    return Refusal(message, status=503, code=code, headers=headers)


def not_supported(message: str, param: str | None = None, code: str = "not_supported") -> InvalidRequestError:
    """A 400 for a well-formed request asking for something this server does not do (yet)."""
    return InvalidRequestError(message, code=code, param=param)


def loc_to_param(loc: tuple[Any, ...]) -> str:
    """pydantic's error location as a field path: ('messages', 0, 'role') -> 'messages[0].role'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def from_validation_error(err: ValidationError) -> InvalidRequestError:
    """A 400 naming the first bad field (and its path), with every problem in the message."""
    problems = []
    for e in err.errors(include_url=False):
        msg = str(e["msg"]).removeprefix("Value error, ")
        if e["type"] == "missing":
            msg = "is required"
        elif e["type"] == "extra_forbidden":
            msg = "is not a known field"
        problems.append((loc_to_param(tuple(e["loc"])), msg))
    param = problems[0][0] if problems else None
    message = "; ".join(f"'{p}': {m}" if p else m for p, m in problems) or "invalid request"
    return InvalidRequestError(message, param=param or None)


def to_imp_error(exc: BaseException) -> ImpError:
    """Any exception as an ImpError; anything unexpected is a 500 that hides its details."""
    if isinstance(exc, ImpError):
        return exc
    if isinstance(exc, ValidationError):
        return from_validation_error(exc)
    if isinstance(exc, HTTPException):
        status = exc.code or 500
        message = exc.description or exc.name
        if status == 404:
            message = "no such route; see docs/API.md for the endpoints this server has"
        elif status == 405:
            message = f"method not allowed here; allowed: {', '.join(sorted(getattr(exc, 'valid_methods', None) or []))}"
        return ImpError(message, code=_HTTP_CODES.get(status, "http_error"), status=status)
    return ImpError("internal server error", code="internal_error", status=500)


def openai_error_body(err: ImpError) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}`."""
    kind = _OPENAI_TYPES.get(err.status) or ("server_error" if err.status >= 500 else "invalid_request_error")
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}


def anthropic_error_body(err: ImpError, request_id: str | None = None) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}`, error.type always one of Anthropic's own."""
    kind = (_ANTHROPIC_CODE_TYPES.get(err.code) or _ANTHROPIC_TYPES.get(err.status)
            or ("api_error" if err.status >= 500 else "invalid_request_error"))
    body: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": err.message}}
    if request_id:
        body["request_id"] = request_id
    return body


def is_anthropic_path(path: str) -> bool:
    """Whether `path` is answered in Anthropic's dialect."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(err: ImpError, path: str, request_id: str | None = None) -> dict[str, Any]:
    """The envelope `path`'s dialect uses."""
    return anthropic_error_body(err, request_id) if is_anthropic_path(path) else openai_error_body(err)
