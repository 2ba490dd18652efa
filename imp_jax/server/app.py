"""The Quart app: dialect blueprints, error envelopes, request ids and request logging around one engine."""
from __future__ import annotations

import logging
import time
from typing import Any

from quart import Quart, Response, g, jsonify, request
from werkzeug.exceptions import HTTPException

from imp_jax.server import admin, anthropic_messages, chat_completions, completions, responses, tokens
from imp_jax.server.context import ServerConfig, install
from imp_jax.server.errors import error_body, is_anthropic_path, to_imp_error
from imp_jax.server.generation import Engine

log = logging.getLogger("imp_jax.server")
MAX_REQUEST_ID = 128
BLUEPRINTS = (admin.bp, chat_completions.bp, completions.bp, tokens.bp, anthropic_messages.bp, responses.bp)


def sanitize_request_id(value: str | None) -> str | None:
    """A client's X-Request-Id cut to printable ASCII and 128 chars; None when nothing is left."""
    if not value:
        return None
    clean = "".join(c for c in value if " " <= c <= "~").strip()[:MAX_REQUEST_ID]
    return clean or None


def create_app(engine: Engine, config: ServerConfig | None = None) -> Quart:
    """The app serving `engine`: every dialect, the probes, and a JSON envelope for every error."""
    app = Quart("imp_jax.server")
    app.config.update(RESPONSE_TIMEOUT=None, MAX_CONTENT_LENGTH=64 * 1024 * 1024)
    app.json.sort_keys = False  # type: ignore[attr-defined]
    install(app, engine, config or ServerConfig())
    for bp in BLUEPRINTS:
        app.register_blueprint(bp)
    app.before_request(_begin)
    app.after_request(_finish)
    app.register_error_handler(HTTPException, _on_error)
    app.register_error_handler(Exception, _on_error)
    return app


async def _begin() -> None:
    g.t0 = time.perf_counter()
    g.client_request_id = sanitize_request_id(request.headers.get("X-Request-Id"))


def _request_id() -> str | None:
    return g.get("client_request_id") or g.get("response_id")


async def _on_error(exc: Exception) -> Any:
    """Every error, the client's or ours, as the path's JSON envelope; details of a 500 go to the log only."""
    err = to_imp_error(exc)
    if err.status >= 500 and err is not exc:
        log.error("unhandled error on %s %s", request.method, request.path, exc_info=exc)
    g.error_message = err.message
    response = jsonify(error_body(err, request.path, _request_id()))
    response.status_code = err.status
    if isinstance(exc, HTTPException) and exc.code == 405 and getattr(exc, "valid_methods", None):
        response.headers["Allow"] = ", ".join(exc.valid_methods)
    return response


async def _finish(response: Response) -> Response:
    rid = _request_id()
    if rid:
        response.headers["X-Request-Id"] = rid
        if is_anthropic_path(request.path):
            response.headers["request-id"] = rid
    ms = (time.perf_counter() - g.get("t0", time.perf_counter())) * 1000
    if 400 <= response.status_code < 500:
        log.warning("HTTP %d %s %s: %s (%.1f ms)", response.status_code, request.method, request.path,
                    g.get("error_message", "-"), ms)
    else:
        log.info("%s %s %d %.1f ms", request.method, request.path, response.status_code, ms)
    return response
