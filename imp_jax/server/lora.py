"""LoRA adapters on the wire: `POST /admin/lora/load` and `/admin/lora/unload`, and the adapters' cards in
`/v1/models` (with their `parent`, as vLLM lists them). The request field `lora` is read for every dialect
in `context.engine_request` (validation.lora_of) and reaches the engine through `lifecycle.begin`.

The engine does the work (runtime/lora.py): load reads and checks the PEFT directory, then fills a
free slot; unload refuses new requests for the name at once and answers once those in flight ended,
or, past its `timeout_s`, gives the name back and answers 503 (imp's answer to a drain that timed out).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from quart import Blueprint, jsonify, request

from imp_jax.errors import ImpError, InvalidRequestError, NotFoundError
from imp_jax.runtime.api import Engine
from imp_jax.server.context import model_name, ready_engine, server
from imp_jax.server.validation import MAX_LORA_NAME as MAX_NAME
from imp_jax.server.validation import parse_json

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
    """`{"path": PEFT dir, "name": optional}`: 200 with the adapter, 400 lora_load_failed, 409 lora_already_loaded
    or lora_slots_full."""
    body = parse_json(await request.get_data())
    path = body.get("path")
    if not isinstance(path, str) or not path.strip():
        raise InvalidRequestError("'path' must be the path of a PEFT adapter directory on the server", param="path")
    name = _name(body["name"]) if body.get("name") is not None else _name(Path(path).stem or path, "path")
    adapter = await _lora_engine().load_lora(name, path)
    return jsonify({**adapter, "loaded": True})


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
    body = parse_json(await request.get_data())
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
    """`/v1/models` entries of the loaded adapters, each naming its base model as `parent`."""
    engine = server().engine
    if not engine.capabilities.lora:
        return []
    base = model_name(server())
    return [{"id": a["name"], "object": "model", "created": created, "owned_by": "imp_jax", "parent": base,
             "root": a["path"], "loaded": True} for a in engine.lora_adapters()]


def adapter_card(name: str, created: int) -> dict[str, Any] | None:
    """The `/v1/models/{name}` card of a loaded adapter, or None."""
    return next((c for c in adapter_cards(created) if c["id"] == name), None)
