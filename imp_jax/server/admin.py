"""Probes and descriptions: `/health`, `/ready`, `/metrics`, `/v1/models`, `/props` (llama.cpp), `/info` (TGI)."""
from __future__ import annotations

import dataclasses
import importlib.metadata
from pathlib import Path
from typing import Any, Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from quart import Blueprint, Response, jsonify, request

from imp_jax.errors import ImpError, InvalidRequestError, NotFoundError
from imp_jax.runtime.api import Engine
from imp_jax.server.access import presented_key
from imp_jax.server.context import json_body, model_name, ready_engine, readiness, server
from imp_jax.server.encoders import encoder_cards, encoders, encoders_ready
from imp_jax.server.errors import RETRY_AFTER_S, not_supported, unavailable
from imp_jax.server.generation import public_engine_message
from imp_jax.server.limits import field_limits
from imp_jax.server.lora import adapter_cards, adapter_card
from imp_jax.server.validation import check_model_name

bp = Blueprint("admin", __name__)


def _version() -> str:
    try:
        return importlib.metadata.version("imp-jax")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


def _engine_fact(read: Callable[[Engine], Any] | None, config_field: str | None = None, default: Any = None) -> Any:
    """A fact of the live engine (a loading engine raises for model facts), else the engine config's
    `config_field` (the server's ServerConfig.engine), else `default`."""
    state = server()
    try:
        value = read(state.engine) if read is not None else None
    except Exception:
        value = None
    if value is None and config_field is not None and state.config.engine is not None:
        value = getattr(state.config.engine, config_field, None)
    return default if value is None else value


def _model_name() -> str:
    return model_name(server())


def _stats() -> dict[str, Any]:
    engine = server().engine
    try:
        return dict(engine.stats())
    except Exception:  # stats are best effort: a loading engine may have none yet
        return {}


# what /health shows a caller without a valid key on a server with keys: imp's documented fields, no counters
PUBLIC_HEALTH = frozenset({"status", "code", "state", "model_loaded", "queue_depth", "suspended", "idle_suspended",
                           "idle_unload_seconds", "kv_blocks_total", "kv_block_size", "kv_capacity_tokens",
                           "kv_ceiling_blocks", "kv_pool_growable", "kv_pool_floored", "kv_pool_bandwidth_gbps"})


def _shown(body: dict[str, Any]) -> dict[str, Any]:
    """`body` for a key holder (or anyone, on a server without keys); imp's fields alone for others: /health
    needs no key (imp's rule), but the engine's counters say how others use the server."""
    keys = server().access.keys
    key = presented_key(request.headers)
    if not keys or (key is not None and keys.accepts(key)):
        return body
    return {k: v for k, v in body.items() if k in PUBLIC_HEALTH}


@bp.get("/health")
async def health() -> Any:
    engine_state = server().engine.state
    stats = _stats()
    body: dict[str, Any] = {
        "status": "ok", "state": engine_state, "model_loaded": engine_state in ("warming_up", "ready"),
        "queue_depth": stats.get("num_running", 0) + stats.get("num_waiting", 0), "suspended": False,
        "idle_suspended": False, **stats,
        "steps_failed_total": stats.get("steps_failed_total", 0),   # steps that raised (only their requests failed)
    }
    if encoders():
        body["encoder_models"] = {name: e.stats() for name, e in encoders().items()}
    if "kv_blocks_total" in stats:   # the pool's capacity, so a caller can check a prompt against it
        # fixed-size pool, sized once: its ceiling is its size, it never grows, and its bandwidth is not probed
        body.update(kv_capacity_tokens=stats["kv_blocks_total"] * stats["kv_block_size"],
                    kv_ceiling_blocks=stats["kv_blocks_total"], kv_pool_growable=False,
                    kv_pool_floored=bool(stats.get("kv_pool_floored", 0)), kv_pool_bandwidth_gbps=0.0)
    if engine_state == "faulted":
        body.update(status="unhealthy", code="engine_faulted")
        return jsonify(_shown(body)), 503
    if body.get("kv_pool_floored"):   # persistent: the pool was sized below a context; restart on a free device
        body.update(status="unhealthy", code="kv_pool_floored")
        return jsonify(_shown(body)), 503
    return jsonify(_shown(body))


@bp.get("/ready")
async def ready() -> Any:
    is_ready, code = readiness()
    if is_ready:   # the encoder models must be serving too
        is_ready, code = encoders_ready()
    engine = server().engine
    replicas = {"replica_states": engine.replica_states()} if engine.capabilities.replicas else {}
    if is_ready:
        return jsonify({"ready": True, "state": engine.state, "model": _model_name(),
                        "idle_suspended": bool(engine.idle_suspended), **replicas})
    fault = {"message": public_engine_message(engine.error)} if code == "engine_faulted" and engine.error else {}
    # a lost multi-host process is named; a device fault's text is not
    retry = RETRY_AFTER_S.get(code)   # a state that passes by itself (loading, swapping): when to look again
    return (jsonify({"ready": False, "code": code, "state": engine.state, **fault, **replicas}), 503,
            {"Retry-After": str(retry)} if retry else {})


@bp.post("/admin/suspend")
async def admin_suspend() -> Any:
    """Operator suspend: 503 `suspended` for new requests, those in flight finish, then the weights and
    KV cache move to host memory (device memory freed). Sticky until POST /admin/resume."""
    engine = _suspendable()
    answer = await engine.suspend()
    if answer["status"] == "faulted":
        raise ImpError("the engine faulted; restart the server", code="engine_faulted", status=500)
    return jsonify(answer)


@bp.post("/admin/resume")
async def admin_resume() -> Any:
    """Back from an operator suspend: weights and KV cache on the device again, requests taken."""
    engine = _suspendable()
    answer = await engine.resume()
    if answer["status"] == "faulted":
        raise ImpError("the engine faulted; restart the server", code="engine_faulted", status=500)
    if answer["status"] == "not_suspended":
        raise ImpError("the engine is not suspended", code="not_suspended", status=409)
    return jsonify(answer)


def _suspendable() -> Engine:
    engine = server().engine
    if engine.state in ("loading", "warming_up"):
        raise unavailable("the model is still loading", "loading")
    if not engine.capabilities.suspend:   # multi-host: the other processes' shards cannot be parked from here
        raise not_supported("suspend is not supported with --num-processes > 1 (multi-host)")
    return engine


@bp.get("/metrics")
async def metrics() -> Any:
    """Prometheus text format, from the app's own registry (metrics.py, engine_metrics.py)."""
    return Response(generate_latest(server().telemetry.registry), status=200, content_type=CONTENT_TYPE_LATEST)


def _model_card(name: str | None = None) -> dict[str, Any]:
    """The served model's card, or (with --models-dir) another model of the directory's, not loaded."""
    state = server()
    served = name is None or (state.engine.state != "no_model" and name == _model_name())
    card = {"id": name or _model_name(), "object": "model", "created": int(state.started_at), "owned_by": "imp_jax",
            "loaded": served and readiness()[0], "task": "generate"}
    if served:
        card["max_model_len"] = _engine_fact(lambda e: e.max_model_len, "max_model_len")
    return card


def _served_card() -> list[dict[str, Any]]:
    state = server()
    return [] if state.engine.state == "no_model" else [_model_card(), *adapter_cards(int(state.started_at))]


@bp.get("/v1/models")
async def models() -> Any:
    state = server()
    extra = encoder_cards(int(state.started_at))   # the embedding / rerank models beside the chat model
    if state.models is None:
        return jsonify({"object": "list", "data": _served_card() + extra})
    return jsonify({"object": "list", "data": [_model_card(name) for name in state.models.models()] + extra})


@bp.get("/v1/models/<path:model_id>")
async def model(model_id: str) -> Any:
    state = server()
    if state.models is not None and model_id in state.models:
        return jsonify(_model_card(model_id))
    for card in encoder_cards(int(state.started_at)):
        if card["id"] == model_id:
            return jsonify(card)
    card = adapter_card(model_id, int(state.started_at))
    if card is not None:
        return jsonify(card)
    check_model_name(model_id, _model_name())
    return jsonify(_model_card())


@bp.post("/admin/models/load")
async def load_model() -> Any:
    """Swap to a model of --models-dir (`{"model": name}`); answers once it serves."""
    state = server()
    body = await json_body()
    name = body.get("model") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        raise InvalidRequestError("'model' must name a model of /v1/models", param="model")
    if state.models is None:
        raise ImpError("this server has no --models-dir to load models from", code="not_supported", status=400,
                       param="model")
    if name not in state.models:
        raise NotFoundError(f"model '{name}' is not in the models directory", code="model_not_found", param="model")
    engine = await state.models.serving(state, name)
    return jsonify({"model": engine.served_name, "loaded": True})


@bp.get("/props")
async def props() -> Any:
    engine = ready_engine()
    defaults = _engine_fact(lambda e: e.default_params)
    params = dataclasses.asdict(defaults) if dataclasses.is_dataclass(defaults) else dict(defaults or {})
    tok = engine.tokenizer
    limits = server().config.image_limits
    return jsonify({
        "default_generation_settings": {
            "n_ctx": engine.max_model_len, "model": engine.served_name,
            "params": {
                "temperature": params.get("temperature"), "top_k": params.get("top_k"),
                "top_p": params.get("top_p"), "min_p": params.get("min_p"), "typical_p": params.get("typical_p"),
                "repeat_penalty": params.get("repetition_penalty"),
                "presence_penalty": params.get("presence_penalty") or 0.0,
                "frequency_penalty": params.get("frequency_penalty") or 0.0,
                "n_predict": -1, "seed": -1, "stop": params.get("stop") or [],
            },
        },
        "total_slots": _engine_fact(lambda e: e.max_num_seqs, "max_num_seqs"),
        "model_path": Path(str(_engine_fact(None, "model", ""))).name,
        "chat_template": tok.chat_template, "bos_token": tok.bos_token, "eos_token": tok.eos_token,
        "modalities": {"vision": engine.vision, "audio": False}, "build_info": f"imp_jax {_version()}",
        "image_limits": {"max_image_bytes": limits.max_bytes, "max_images_per_request": limits.max_images,
                         "max_image_pixels": limits.max_pixels, "max_video_frames": limits.max_video_frames,
                         "max_request_bytes": server().body_limit()},
    })


@bp.get("/info")
async def info() -> Any:
    max_len = _engine_fact(lambda e: e.max_model_len, "max_model_len")
    return jsonify({
        "model_id": _model_name(), "model_sha": None,
        "model_dtype": str(_engine_fact(lambda e: e.dtype, "dtype", "auto")),
        "model_device_type": str(_engine_fact(lambda e: e.device, "device", "unknown")),
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": _engine_fact(lambda e: e.max_num_seqs, "max_num_seqs"), "max_best_of": 1,
        "max_stop_sequences": field_limits().stop_strings, "max_input_tokens": max_len - 1 if max_len else None,
        "max_total_tokens": max_len, "validation_workers": 1, "max_client_batch_size": 1,
        "router": "imp_jax", "version": _version(), "sha": None, "docker_label": None,
    })
