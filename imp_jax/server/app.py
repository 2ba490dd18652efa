"""The Quart app: dialect blueprints, access checks, error envelopes, request ids, and a record of every request."""
from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from quart import Quart, Response, g, jsonify, request
from werkzeug.exceptions import HTTPException

from imp_jax.runtime.api import Engine
from imp_jax.server import (admin, anthropic_messages, chat_completions, completions, embeddings, infill, limits,
                            lora, reasoning, responses, scoring, sessions, tokens, ui)
from imp_jax.server.browsers import check_json_content_type, loggable
from imp_jax.server.context import ServerConfig, install, server
from imp_jax.server.errors import error_body, is_anthropic_path, to_imp_error
from imp_jax.server.generation import public_error
from imp_jax.server.request_record import RequestRecord

log = logging.getLogger("imp_jax.server")
MAX_REQUEST_ID = 128
BLUEPRINTS = (admin.bp, chat_completions.bp, completions.bp, tokens.bp, anthropic_messages.bp, responses.bp,
              reasoning.bp, infill.bp, sessions.bp, scoring.bp, embeddings.bp, lora.bp)


def sanitize_request_id(value: str | None) -> str | None:
    """A client's X-Request-Id cut to printable ASCII and 128 chars; None when nothing is left."""
    if not value:
        return None
    clean = "".join(c for c in value if " " <= c <= "~").strip()[:MAX_REQUEST_ID]
    return clean or None


def create_app(engine: Engine, config: ServerConfig | None = None) -> Quart:
    """The app serving `engine`: every dialect, the probes, and a JSON envelope for every error."""
    config = config or ServerConfig()
    app = Quart("imp_jax.server")
    app.config.update(RESPONSE_TIMEOUT=None, MAX_CONTENT_LENGTH=config.max_request_bytes or limits.DEFAULT_REQUEST_BYTES)
    app.json.sort_keys = False  # type: ignore[attr-defined]
    state = install(app, engine, config)
    for bp in BLUEPRINTS:
        app.register_blueprint(bp)
    ui.register(app, config.ui)
    app.before_request(_begin)
    app.after_request(_finish)
    app.teardown_request(_release_model_lease)
    app.register_error_handler(HTTPException, _on_error)
    app.register_error_handler(Exception, _on_error)

    @app.after_serving
    async def _close_telemetry() -> None:
        state.telemetry.close()

    return app


async def _begin() -> Any:
    """Open the request's record (with a server id for X-Request-Id), answer a CORS preflight, check access."""
    g.t0 = time.perf_counter()
    g.client_request_id = sanitize_request_id(request.headers.get("X-Request-Id"))
    g.setdefault("response_id", f"req_{uuid.uuid4().hex}")
    g.record = RequestRecord(request.method, request.path, g.response_id, client_id=g.client_request_id,
                             client_addr=request.remote_addr, traceparent=request.headers.get("traceparent"),
                             route=request.url_rule.rule if request.url_rule is not None else None)
    state = server()
    limits.FIELD_LIMITS.set(state.field_limits)   # the validators' limits for this request (--max-stop-strings, ...)
    state.hosts.check(request.headers.get("Host"))
    if state.cors.is_preflight(request.method, request.headers) and state.cors.allowed(request.headers.get("Origin")):
        return Response(status=204, headers=state.cors.preflight_headers(request.headers))
    state.access.check(request.path, request.headers, request.remote_addr, request.content_length,
                       state.body_limit())
    check_json_content_type(request.method, request.headers)
    return None


async def _release_model_lease(exc: BaseException | None) -> None:
    """The engine a --models-dir request was handed may be swapped out once the request is done with it."""
    lease = g.pop("model_lease", None)
    if lease is not None:
        lease.release()


def _request_id() -> str | None:
    return g.get("client_request_id") or g.get("response_id")


async def _on_error(exc: Exception) -> Any:
    """Every error, the client's or ours, as the path's JSON envelope; details of a 500 go to the log only."""
    err = to_imp_error(exc)
    if err.status >= 500 and err is not exc:
        log.error("unhandled error on %s %s", request.method, loggable(request.path), exc_info=exc)
    err = public_error(err)
    g.error_message = err.message
    record = g.get("record")
    if record is not None:
        record.error_code, record.error_message = err.code, err.message
    response = jsonify(error_body(err, request.path, _request_id()))
    response.status_code = err.status
    response.headers.update(getattr(err, "headers", {}))
    if isinstance(exc, HTTPException) and exc.code == 405 and getattr(exc, "valid_methods", None):
        response.headers["Allow"] = ", ".join(exc.valid_methods)
    return response


async def _finish(response: Response) -> Response:
    rid = _request_id()
    if rid:
        response.headers["X-Request-Id"] = rid
        if is_anthropic_path(request.path):
            response.headers["request-id"] = rid
    state = server()
    response.headers.update(state.cors.response_headers(request.headers.get("Origin")))
    ms = (time.perf_counter() - g.get("t0", time.perf_counter())) * 1000
    if 400 <= response.status_code < 500:
        log.warning("HTTP %d %s %s: %s (%.1f ms)", response.status_code, request.method, loggable(request.path),
                    loggable(g.get("error_message", "-"), 500), ms)
    else:
        log.info("%s %s %d %.1f ms", request.method, loggable(request.path), response.status_code, ms)
    record = g.get("record")
    if record is not None:
        record.status, record.response_done = response.status_code, True
        state.telemetry.report_if_complete(record)
    return response
