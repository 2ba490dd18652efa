"""Per-app server state (the engine, its config, lifecycle flags) and the accessors handlers use."""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from quart import current_app, g, request

from imp_jax.server.errors import unavailable
from imp_jax.server.generation import Engine
from imp_jax.server.validation import M, check_model_name, parse_json, parse_model

_KEY = "imp_jax"


@dataclasses.dataclass
class ServerConfig:
    """Server-side settings; `engine` is the engine's own config (EngineConfig), shown by /props and /info."""

    host: str = "127.0.0.1"
    port: int = 8080
    log_level: str = "info"
    engine: Any = None
    responses_store_ttl_s: float = 24 * 3600.0       # /v1/responses store: how long a stored response lives,
    responses_store_max_entries: int = 4096          # how many are kept, and their JSON bytes in all;
    responses_store_max_bytes: int = 64 * 1024 * 1024  # past a cap the least recently used go first


@dataclasses.dataclass
class ServerContext:
    engine: Engine
    config: ServerConfig
    started_at: float = dataclasses.field(default_factory=time.time)
    draining: bool = False


def install(app: Any, engine: Engine, config: ServerConfig) -> ServerContext:
    """Attach the server state to `app`."""
    state = ServerContext(engine, config)
    app.extensions[_KEY] = state
    return state


def server() -> ServerContext:
    """The running app's server state."""
    return current_app.extensions[_KEY]


def state_of(app: Any) -> ServerContext:
    """The server state attached to `app` (outside a request)."""
    return app.extensions[_KEY]


def readiness() -> tuple[bool, str]:
    """(ready, code): whether a generation request is taken now, and else why not."""
    state = server()
    if state.draining:
        return False, "draining"
    engine_state = getattr(state.engine, "state", "ready")
    if engine_state == "ready":
        return True, "ready"
    if engine_state in ("loading", "warming_up"):
        return False, "loading"
    if engine_state == "faulted":
        return False, "engine_faulted"
    return False, "stopped"


def ready_engine() -> Engine:
    """The engine, or a 503 saying why it cannot take a request now."""
    ready, code = readiness()
    if not ready:
        messages = {"loading": "the model is still loading", "draining": "the server is shutting down",
                    "engine_faulted": "the engine faulted; restart the server", "stopped": "the engine stopped"}
        raise unavailable(messages[code], code)
    return server().engine


async def engine_request(cls: type[M]) -> tuple[M, Engine]:
    """The request body as `cls` (400 if it is not), the ready engine (503 if not), and a 404
    unless the body's `model`, when it names one, is the model served here."""
    req = parse_model(cls, parse_json(await request.get_data()))
    engine = ready_engine()
    model = getattr(req, "model", None)
    if model is not None:
        check_model_name(model, engine.served_name)
    return req, engine


def set_response_id(response_id: str) -> None:
    """The id a generation response carries in X-Request-Id when the client sent none."""
    g.response_id = response_id
