"""The encoder models served beside the chat model (--embedding-model, --rerank-model), by name.

Each is a runtime EncoderEngine (embeddings or a cross-encoder) with its own thread, started and
stopped with the app. A request's `model` picks the engine; naming an encoder on a generation
route, or the chat model on an encoder route, is a 400 naming the model (`wrong_model_task`).
"""
from __future__ import annotations

from typing import Any

from quart import current_app

from imp_jax.errors import InvalidRequestError
from imp_jax.runtime.api import Encoder

KEY = "imp_jax_encoders"
TASK_ROUTES = {"generate": "/v1/chat/completions, /v1/completions, /v1/messages and /v1/responses",
               "embed": "/v1/embeddings and /v1/rerank", "score": "/v1/rerank"}


def install_encoders(app: Any, engines: list[Encoder]) -> None:
    """Serve `engines` (EncoderEngine) from `app`: started before it serves, shut down after."""
    names = [e.served_name for e in engines]
    if len(set(names)) != len(names):
        raise ValueError(f"two encoder models share the name {names}; serve each once")
    app.extensions[KEY] = {e.served_name: e for e in engines}

    @app.before_serving
    async def _start_encoders() -> None:
        for e in engines:
            e.start()

    @app.after_serving
    async def _stop_encoders() -> None:
        for e in engines:
            e.shutdown(timeout=5.0)


def encoders_of(app: Any) -> dict[str, Encoder]:
    """name -> EncoderEngine of the app (empty without encoder models)."""
    return app.extensions.get(KEY, {})


def encoders() -> dict[str, Encoder]:
    return encoders_of(current_app)


def task_of(engine: Encoder) -> str:
    try:
        return engine.task
    except Exception:
        return "embed"


def refuse_encoder_model(model: str | None, route: str = "this route") -> None:
    """400 when a generation request names an encoder model."""
    engine = encoders().get(model) if model is not None else None
    if engine is not None:
        task = task_of(engine)
        raise InvalidRequestError(f"model '{model}' is an {'embedding' if task == 'embed' else 'rerank'} model "
                                  f"(task '{task}'): it serves {TASK_ROUTES[task]}, not {route}",
                                  param="model", code="wrong_model_task")


def encoders_ready() -> tuple[bool, str]:
    """(every encoder ready, the first one's code when not: loading / engine_faulted)."""
    for e in encoders().values():
        if e.state in ("loading", "warming_up"):
            return False, "loading"
        if e.state != "ready":
            return False, "engine_faulted" if e.state == "faulted" else "stopped"
    return True, "ready"


def encoder_cards(created: int) -> list[dict[str, Any]]:
    """/v1/models entries of the encoders."""
    cards = []
    for name, e in encoders().items():
        card = {"id": name, "object": "model", "created": created, "owned_by": "imp_jax",
                "loaded": e.state == "ready", "task": task_of(e)}
        if e.state == "ready":
            card["max_model_len"] = e.max_model_len
            if card["task"] == "embed":
                card["dimensions"] = e.dimensions
        cards.append(card)
    return cards
