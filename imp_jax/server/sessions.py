"""`POST /v1/sessions/{id}/close`: release the KV blocks a `session_id` keeps pinned for its next turn
(runtime/scheduling/sessions.py); they are also released after `--session-ttl-s` idle seconds."""
from __future__ import annotations

from typing import Any

from quart import Blueprint, jsonify

from imp_jax.errors import NotFoundError
from imp_jax.server.context import cache_salt, engine_session_id, ready_engine
from imp_jax.server.errors import not_supported

bp = Blueprint("sessions", __name__)


@bp.post("/v1/sessions/<session_id>/close")
async def close_session(session_id: str) -> Any:
    engine = ready_engine()
    if not engine.capabilities.sessions:
        raise not_supported("this engine keeps no sessions (no KV blocks to pin)", param="session_id")
    if not await engine.close_session(engine_session_id(session_id, cache_salt())):
        raise NotFoundError(f"no open session '{session_id}' (never opened, closed, or expired)",
                            code="session_not_found", param="session_id")
    return jsonify({"id": session_id, "object": "session", "closed": True})
