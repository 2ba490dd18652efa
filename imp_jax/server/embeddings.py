"""`POST /v1/embeddings` (OpenAI) and `POST /v1/rerank`, `POST /rerank` (Cohere / Jina / vLLM), on the encoders.

Inputs are tokenized here (off the event loop) and checked against the model's context; they wait
for the encoders within their own caps (admission.py, --max-queued-embedding-inputs / -tokens); the
encoder engine batches them with every other client's. docs/API.md has the wire shapes.
"""
from __future__ import annotations

import base64
import time
import uuid
from typing import Any

import numpy as np
from quart import Blueprint, g, jsonify, request

from imp_jax.errors import ImpError, InvalidRequestError, NotFoundError
from imp_jax.runtime.api import Encoder
from imp_jax.runtime.vectors import finish_embeddings
from imp_jax.server.access import tenant_of
from imp_jax.server.context import model_name, parse_body, server
from imp_jax.server.encoders import TASK_ROUTES, encoders, task_of
from imp_jax.server.errors import unavailable
from imp_jax.server.limits import check_chars, json_reply, max_prompt_chars, off_loop
from imp_jax.server.tenants import admit_both
from imp_jax.server.validation import WireModel, check_token_ids

bp = Blueprint("embeddings", __name__)
MAX_INPUTS = 2048   # inputs of one /v1/embeddings request, documents of one /v1/rerank request
Item = tuple[list[int], list[int]]


class EmbeddingRequest(WireModel):
    model: str | None = None
    input: Any = None
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate: bool = False                    # TEI's name: cut inputs to the model's context
    truncate_prompt_tokens: int | None = None  # vLLM's: cut to this many tokens (-1: the context)


class RerankRequest(WireModel):
    model: str | None = None
    query: Any = None
    documents: Any = None
    top_n: int | None = None
    return_documents: bool = True
    truncate: bool = False
    truncate_prompt_tokens: int | None = None


def pick_encoder(model: str | None, tasks: tuple[str, ...], route: str) -> Encoder:
    """The encoder `model` names (or, unnamed, the first loaded one of `tasks`, in that order of
    preference), ready to serve; 400 when it serves another task, 404 when nothing has that name."""
    state = server()
    found = encoders()
    if state.draining:
        raise unavailable("the server is shutting down", "draining")
    if model is not None:
        engine = found.get(model)
        if engine is None:
            generative = model == model_name(state) or (state.models is not None and model in state.models)
            if generative:
                raise InvalidRequestError(f"model '{model}' is a generative model (task 'generate'): it serves "
                                          f"{TASK_ROUTES['generate']}, not {route}; name one of "
                                          f"{_names(found, tasks)}", param="model", code="wrong_model_task")
            raise NotFoundError(f"model '{model}' is not served here; for {route} name one of "
                                f"{_names(found, tasks)}", code="model_not_found", param="model")
        if task_of(engine) not in tasks:
            raise InvalidRequestError(f"model '{model}' is a {task_of(engine)} model: it serves "
                                      f"{TASK_ROUTES[task_of(engine)]}, not {route}", param="model",
                                      code="wrong_model_task")
    else:
        ranked = sorted((e for e in found.values() if task_of(e) in tasks), key=lambda e: tasks.index(task_of(e)))
        if not ranked:
            how = "--embedding-model" if tasks == ("embed",) else "--rerank-model or --embedding-model"
            raise InvalidRequestError(f"no model for {route} is loaded; start the server with {how}",
                                      param="model", code="model_not_loaded")
        engine = ranked[0]
    if engine.state in ("loading", "warming_up"):
        raise unavailable(f"the model {engine.served_name} is still loading", "loading")
    if engine.state != "ready":
        raise ImpError(f"the model {engine.served_name} failed: {engine.error or engine.state}",
                       code="engine_faulted", status=500)
    return engine


def _names(found: dict[str, Encoder], tasks: tuple[str, ...]) -> str:
    names = [n for n, e in found.items() if task_of(e) in tasks]
    return ", ".join(f"'{n}'" for n in names) if names else "(none loaded: see --embedding-model)"


def _strings_or_ids(value: Any, param: str) -> list[str] | list[list[int]]:
    """OpenAI's `input`: a string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        value = [value]
    if not isinstance(value, list):
        raise InvalidRequestError(f"'{param}' must be a string, a list of strings, a list of token ids or a list "
                                  "of lists of token ids", param=param)
    if not value:
        raise InvalidRequestError(f"'{param}' must not be empty", param=param)
    if len(value) > MAX_INPUTS:
        raise InvalidRequestError(f"'{param}' has {len(value)} entries; at most {MAX_INPUTS} per request",
                                  param=param, code="too_many_inputs")
    kind = str if isinstance(value[0], str) else list
    for i, v in enumerate(value):
        ok = isinstance(v, kind) and (kind is str or all(isinstance(t, int) and not isinstance(t, bool) for t in v))
        if not ok:
            raise InvalidRequestError(f"'{param}[{i}]' must be {'a string' if kind is str else 'a list of token ids'}"
                                      " like the first entry", param=f"{param}[{i}]")
        if not v:
            raise InvalidRequestError(f"'{param}[{i}]' must not be empty", param=f"{param}[{i}]")
    return value


def _cut_to(req: Any, engine: Encoder) -> int | None:
    """The length the request asks inputs to be cut to (None: refuse what is too long)."""
    k = req.truncate_prompt_tokens
    if k is not None:
        if k == -1:
            return engine.max_model_len
        if not 1 <= k <= engine.max_model_len:
            raise InvalidRequestError(f"'truncate_prompt_tokens' must be -1 or 1 to {engine.max_model_len} "
                                      "(the model's context)", param="truncate_prompt_tokens")
        return k
    return engine.max_model_len if req.truncate else None


def _fit(items: list[Item], engine: Encoder, cut: int | None, params: list[str], keeps_last: bool) -> list[Item]:
    """Inputs within the context: cut to `cut` tokens when asked (keeping the closing [SEP] of tokenized
    text: `keeps_last`), else a 400 naming (`params[i]`) the first that is too long."""
    out = []
    for i, (ids, types) in enumerate(items):
        limit = cut if cut is not None else engine.max_model_len
        if len(ids) > limit:
            if cut is None:
                raise InvalidRequestError(
                    f"'{params[i]}' has {len(ids)} tokens; the model {engine.served_name} takes at most "
                    f"{engine.max_model_len}. Shorten it or send \"truncate\": true", param=params[i],
                    code="context_length_exceeded")
            keep = limit - 1 if keeps_last and limit > 1 else limit
            ids, types = ids[:keep] + (ids[-1:] if keep < limit else []), types[:keep] + (types[-1:] if keep < limit else [])
        out.append((ids, types))
    return out


def _indexed(param: str, n: int) -> list[str]:
    return [f"{param}[{i}]" for i in range(n)]


def _check_chars(texts: list[str], engine: Encoder, param: str) -> None:
    limit = max_prompt_chars(server().config.max_prompt_chars, engine.max_model_len)
    for i, t in enumerate(texts):
        check_chars(t, f"{param}[{i}]", limit)


def _begin_record(engine: Encoder, endpoint: str, tokens: int) -> None:
    rec = g.record
    rec.endpoint, rec.model, rec.prompt_tokens = endpoint, engine.served_name, tokens
    rec.submitted_at = time.monotonic()


def _end_record(outcome: str) -> None:
    rec = g.record
    rec.generated = True   # the engine took it: metrics, the request log and a span report it
    rec.end_generation(outcome)


async def _run(engine: Encoder, items: list[Item], endpoint: str) -> np.ndarray:
    """The encoder's output for `items`, holding their places in the encoder queue (429 past its caps) and
    in its caller's per-key counts (tenants.py: a request in flight, its tokens a minute)."""
    state = server()
    tokens = sum(len(ids) for ids, _ in items)
    tenant = tenant_of(request.headers, request.remote_addr, bool(state.access.keys))
    ticket, hold = admit_both(state.encoder_gate, state.tenants, tenant, tokens, items=len(items))
    hold.started()   # an encoder answers in one piece: no first token to wait for
    _begin_record(engine, endpoint, tokens)
    try:
        out = await engine.run(items)
    except BaseException:
        _end_record("error")
        raise
    finally:
        ticket.release()
        hold.end(0)
    _end_record("ok")
    return out


@bp.post("/v1/embeddings")
async def create_embeddings() -> Any:
    req: EmbeddingRequest = await parse_body(EmbeddingRequest)
    engine = pick_encoder(req.model, ("embed",), "/v1/embeddings")
    if req.encoding_format not in ("float", "base64"):
        raise InvalidRequestError("'encoding_format' must be 'float' or 'base64'", param="encoding_format")
    if req.dimensions is not None and not 1 <= req.dimensions <= engine.dimensions:
        raise InvalidRequestError(f"'dimensions' must be 1 to {engine.dimensions} (the model's size)",
                                  param="dimensions")
    if req.input is None:
        raise InvalidRequestError("'input' is required", param="input")
    inputs = _strings_or_ids(req.input, "input")
    cut = _cut_to(req, engine)
    if isinstance(inputs[0], str):
        _check_chars(inputs, engine, "input")   # type: ignore[arg-type]
        items = await off_loop(engine.tokenizer.encode_batch, inputs)
    else:
        for i, ids in enumerate(inputs):
            check_token_ids(ids, engine.vocab_size, f"input[{i}]")   # type: ignore[arg-type]
        items = [(list(ids), [0] * len(ids)) for ids in inputs]   # type: ignore[arg-type]
    items = _fit(items, engine, cut, _indexed("input", len(items)), keeps_last=isinstance(inputs[0], str))
    vectors = await _run(engine, items, "embeddings")
    vectors = await off_loop(finish_embeddings, vectors, req.dimensions, engine.normalize)
    tokens = sum(len(ids) for ids, _ in items)

    def reply() -> dict[str, Any]:
        data = [{"object": "embedding", "index": i,
                 "embedding": (base64.b64encode(v.astype("<f4").tobytes()).decode()
                               if req.encoding_format == "base64" else v.tolist())} for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": engine.served_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    return await json_reply(reply)


def _documents(value: Any) -> list[str]:
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("'documents' must be a non-empty list of strings or {\"text\": ...} objects",
                                  param="documents")
    if len(value) > MAX_INPUTS:
        raise InvalidRequestError(f"'documents' has {len(value)} entries; at most {MAX_INPUTS} per request",
                                  param="documents", code="too_many_inputs")
    out = []
    for i, d in enumerate(value):
        text = d.get("text") if isinstance(d, dict) else d
        if not isinstance(text, str) or not text:
            raise InvalidRequestError(f"'documents[{i}]' must be a non-empty string or an object with a non-empty "
                                      "'text'", param=f"documents[{i}]")
        out.append(text)
    return out


@bp.post("/v1/rerank")
@bp.post("/rerank")
async def rerank() -> Any:
    req: RerankRequest = await parse_body(RerankRequest)
    engine = pick_encoder(req.model, ("score", "embed"), request.path)
    if not isinstance(req.query, str) or not req.query:
        raise InvalidRequestError("'query' must be a non-empty string", param="query")
    docs = _documents(req.documents)
    if req.top_n is not None and req.top_n < 1:
        raise InvalidRequestError("'top_n' must be at least 1", param="top_n")
    cut = _cut_to(req, engine)
    _check_chars([req.query], engine, "query")
    _check_chars(docs, engine, "documents")
    cross = task_of(engine) == "score"
    if cross:
        items = await off_loop(engine.tokenizer.encode_pairs, req.query, docs)
        items = _fit(items, engine, cut, _indexed("documents", len(items)), keeps_last=True)
        logits = await _run(engine, items, "rerank")
        scores = 1.0 / (1.0 + np.exp(-logits[:, 0].astype(np.float64)))   # sigmoid, as vLLM and sentence-transformers
    else:
        items = await off_loop(engine.tokenizer.encode_batch, [req.query, *docs])
        items = _fit(items, engine, cut, ["query", *_indexed("documents", len(docs))], keeps_last=True)
        vectors = finish_embeddings(await _run(engine, items, "rerank"), None, True)
        scores = vectors[1:] @ vectors[0]   # cosine similarity
    order = sorted(range(len(docs)), key=lambda i: (-float(scores[i]), i))[:req.top_n or len(docs)]
    results = []
    for i in order:
        r: dict[str, Any] = {"index": i, "relevance_score": float(scores[i])}
        if req.return_documents:
            r["document"] = {"text": docs[i]}
        results.append(r)
    tokens = sum(len(ids) for ids, _ in items)
    return jsonify({"id": f"rerank-{uuid.uuid4().hex}", "model": engine.served_name, "results": results,
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
