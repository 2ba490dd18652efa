"""LoRA adapters on the wire: `POST /admin/lora/load` and `/admin/lora/unload`, and the adapters' cards in
`/v1/models` (with their `parent`, as vLLM lists them). The request field `lora` is read for every dialect
in `context.engine_request` (validation.lora_of) into the RequestContext, which builds the engine request with it.

A run-time load reads only what the operator allowed: a `path` inside `--lora-dir` (resolved: no `..`
or link leading out) or one of the start-up `--lora` paths; an answer never shows a host path
(docs/SECURITY.md). The engine does the work (runtime/scheduling/lora.py): load reads and checks the PEFT directory, then fills a
free slot; unload refuses new requests for the name at once and answers once those in flight ended,
or, past its `timeout_s`, gives the name back and answers 503 (imp's answer to a drain that timed out).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from quart import Blueprint, jsonify

from imp_jax.errors import ImpError, InvalidRequestError, NotFoundError
from imp_jax.runtime.api import Engine
from imp_jax.server.context import json_body, model_name, ready_engine, server
from imp_jax.server.validation import MAX_LORA_NAME as MAX_NAME

bp = Blueprint("lora", __name__)


def _name(value: Any, field: str = "name") -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME or not value.isprintable():
        raise InvalidRequestError(f"'{field}' must be a non-empty string of at most {MAX_NAME} printable characters",
                                  param=field)
    return value


def _lora_engine() -> Engine:
    """The engine, 409 (imp's answer) while there is no model or it is operator-suspended."""
    try:
        engine = ready_engine()
    except ImpError as e:
        if e.code in ("no_model", "suspended"):
            raise ImpError(e.message, code=e.code, status=409) from None
        raise
    if not engine.capabilities.lora:
        raise InvalidRequestError("this server has no LoRA adapter slots; start it with --max-loras N",
                                  code="lora_disabled", param="name")
    return engine


@bp.post("/admin/lora/load")
async def load() -> Any:
    """`{"path": PEFT dir, "name": optional}`: 200 with the adapter, 400 lora_load_failed (or naming `path`
    outside what may be read), 409 lora_already_loaded or lora_slots_full."""
    body = await json_body()
    path = body.get("path")
    if not isinstance(path, str) or not path.strip():
        raise InvalidRequestError("'path' must be the path of a PEFT adapter directory on the server", param="path")
    name = _name(body["name"]) if body.get("name") is not None else _name(Path(path).stem or path, "path")
    engine = _lora_engine()
    place = allowed_path(path)
    try:
        adapter = await engine.load_lora(name, str(place))
    except ImpError as e:
        e.message = _public(e.message, place, path)
        raise
    return jsonify({**adapter, "path": path, "loaded": True})


def _startup_paths() -> dict[Path, str]:
    """The start-up `--lora NAME=PATH` adapters' resolved paths (a run-time load may read them again)."""
    engine_config = server().config.engine
    specs = getattr(engine_config, "lora", None) or []
    return {Path(spec.split("=", 1)[1]).resolve(): spec.split("=", 1)[0] for spec in specs}


def allowed_path(path: str) -> Path:
    """Where `path` may be read: a start-up adapter's path, else a place inside --lora-dir (after every link and
    `..` is resolved). A 400 naming `path` otherwise, and `lora_load_failed` when nothing is there; the
    messages name the client's own `path`, never where it resolved to."""
    if Path(path).resolve() in _startup_paths():
        return Path(path).resolve()
    lora_dir = server().config.lora_dir
    if lora_dir is None:
        raise InvalidRequestError("'path' is not a start-up --lora adapter, and this server loads adapters by path "
                                  "at run time only from its --lora-dir, which is not set", param="path")
    root = Path(lora_dir).resolve()
    place = (root / path).resolve()
    if place == root or not place.is_relative_to(root):
        raise InvalidRequestError("'path' must name an adapter inside --lora-dir (relative to it; no '..' and no "
                                  "link leading out of it)", param="path")
    if not place.exists():
        raise InvalidRequestError(f"adapter {path!r} not found under --lora-dir", code="lora_load_failed",
                                  param="path")
    return place


def _public(message: str, place: Path, path: str) -> str:
    """An engine message about the adapter at `place` with the host's paths replaced by the client's `path`
    (the adapter's directory) and `--lora-dir` (the directory above it)."""
    folder = place if place.is_dir() else place.parent
    message = message.replace(str(folder), f"adapter {path!r}")
    lora_dir = server().config.lora_dir
    return message.replace(str(Path(lora_dir).resolve()), "--lora-dir") if lora_dir else message


UNLOAD_TIMEOUT_S = 30.0   # how long an unload waits for the adapter's requests by default
MAX_UNLOAD_TIMEOUT_S = 3600.0


def _timeout(value: Any) -> float:
    if value is None:
        return UNLOAD_TIMEOUT_S
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_UNLOAD_TIMEOUT_S:
        raise InvalidRequestError(f"'timeout_s' must be a number of seconds above 0 and at most "
                                  f"{MAX_UNLOAD_TIMEOUT_S:g}", param="timeout_s")
    return float(value)


@bp.post("/admin/lora/unload")
async def unload() -> Any:
    """`{"name": ...}` (or `{"id": N}`), optional `timeout_s` (default 30): answers once the requests using
    the adapter ended; 404 lora_not_found; 503 lora_unload_timeout (the adapter stays loaded) when they
    have not ended within `timeout_s`."""
    body = await json_body()
    timeout_s = _timeout(body.get("timeout_s"))
    engine = _lora_engine()
    if isinstance(body.get("id"), int) and not isinstance(body.get("id"), bool) and body.get("name") is None:
        match = [a["name"] for a in engine.lora_adapters() if a["id"] == body["id"]]
        name = match[0] if match else None
        if name is None:
            raise NotFoundError(f"no LoRA adapter has id {body['id']}", code="lora_not_found", param="id")
    else:
        name = _name(body.get("name"))
    adapter = await engine.unload_lora(name, timeout_s)
    if adapter is None:
        raise NotFoundError(f"no LoRA adapter named '{name}' is loaded", code="lora_not_found", param="name")
    return jsonify({**adapter, "unloaded": True})


def adapter_cards(created: int) -> list[dict[str, Any]]:
    """`/v1/models` entries of the loaded adapters, each naming its base model as `parent` (by name only: where
    an adapter was read from is the server's business)."""
    engine = server().engine
    if not engine.capabilities.lora:
        return []
    base = model_name(server())
    return [{"id": a["name"], "object": "model", "created": created, "owned_by": "imp_jax", "parent": base,
             "loaded": True} for a in engine.lora_adapters()]   # no "root": the path is the host's


def adapter_card(name: str, created: int) -> dict[str, Any] | None:
    """The `/v1/models/{name}` card of a loaded adapter, or None."""
    return next((c for c in adapter_cards(created) if c["id"] == name), None)
