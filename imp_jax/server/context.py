"""Per-app server state (the engine, its config, access, queue, telemetry) and the accessors handlers use."""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from quart import current_app, g, request

from imp_jax.errors import ImpError, InvalidRequestError
from imp_jax.runtime.api import Engine
from imp_jax.runtime.request import GenerationRequest, SamplingParams
from imp_jax.server import limits
from imp_jax.server.access import Access, key_digest, presented_key, tenant_of
from imp_jax.server.admission import ENCODER_NAMES, AdmissionGate
from imp_jax.server.browsers import HostCheck, default_allowed_hosts, is_loopback
from imp_jax.server.config import ServerConfig
from imp_jax.server.cors import Cors
from imp_jax.server.encoders import refuse_encoder_model
from imp_jax.server.fields import check_fields
from imp_jax.server.errors import unavailable
from imp_jax.server.models_dir import ModelDirectory
from imp_jax.server.responses_store import STORE_KEY
from imp_jax.server.telemetry import Telemetry
from imp_jax.server.tenants import TenantLimits
from imp_jax.server.validation import (M, check_model_name, is_adapter, lora_of, parse_json, parse_model,
                                       refuse_not_yet, speculative_of)

log = logging.getLogger("imp_jax.server")
_KEY = "imp_jax"
MAX_CLIENT_IDS = 4096   # client X-Request-Ids remembered for /v1/requests/{id}/... (oldest forgotten first)


@dataclasses.dataclass
class ServerContext:
    engine: Engine
    config: ServerConfig
    access: Access
    gate: AdmissionGate
    telemetry: Telemetry
    cors: Cors
    hosts: HostCheck
    started_at: float = dataclasses.field(default_factory=time.time)
    draining: bool = False
    # (owner, X-Request-Id) -> engine id, and engine id -> owner (caller_owner): one key's ids name only its
    # own requests, for /v1/requests/{id}/...
    client_ids: OrderedDict[tuple[str | None, str], str] = dataclasses.field(default_factory=OrderedDict)
    id_owners: OrderedDict[str, str | None] = dataclasses.field(default_factory=OrderedDict)
    models: ModelDirectory | None = None   # --models-dir: the models this server may swap to
    field_limits: limits.FieldLimits = limits.FieldLimits()   # --max-stop-strings, --max-tools, ...
    tenants: TenantLimits = dataclasses.field(default_factory=TenantLimits)   # --max-concurrent-per-key, ...
    encoder_gate: AdmissionGate = dataclasses.field(default_factory=AdmissionGate)   # embeddings and rerank

    def max_model_len(self) -> int | None:
        """The loaded model's context, or None while none is (loading, no model)."""
        try:
            return int(self.engine.max_model_len) or None
        except Exception:  # a loading engine cannot say yet
            return None

    def body_limit(self) -> int:
        """The request body limit in bytes now (limits.max_request_bytes)."""
        return limits.max_request_bytes(self.config.max_request_bytes, self.config.max_prompt_chars,
                                        self.max_model_len())

    def prompt_chars(self, engine: Engine | None = None) -> int:
        """Characters of prompt text one request may have tokenized (limits.max_prompt_chars)."""
        length = engine.max_model_len if engine is not None else self.max_model_len()
        return limits.max_prompt_chars(self.config.max_prompt_chars, length)

    def engine_id(self, request_id: str, owner: str | None) -> str | None:
        """The engine's request id for `owner`'s response id or X-Request-Id; None when it names no request
        of theirs (with API keys, another key's request is as unknown as no request; a request among the
        MAX_CLIENT_IDS most recent only)."""
        engine_id = self.client_ids.get((owner, request_id), request_id)
        if self.access.keys and self.id_owners.get(engine_id, "") != owner:
            return None
        return engine_id


def install(app: Any, engine: Engine, config: ServerConfig) -> ServerContext:
    """Attach the server state to `app`; a bad key file or request-log path is a ValueError here."""
    gate = AdmissionGate(config.max_queued_requests, config.max_queued_tokens)
    access = Access(config.api_key_grants(), config.rate_limit, config.max_request_bytes, config.metrics_public,
                    ui_public=config.ui, admin_open=config.admin_open,
                    auth_failures_per_minute=config.auth_failures_per_minute)

    def store_stats() -> dict[str, int]:
        store = app.extensions.get(STORE_KEY)
        return store.stats() if store is not None else {}

    def stats() -> dict[str, Any]:
        try:
            return dict(app.extensions[_KEY].engine.stats())   # the current engine (models can be swapped)
        except Exception:  # a loading engine may have no stats yet
            return {}

    telemetry = Telemetry(config, gate, stats, lambda: model_status(app.extensions[_KEY]), store_stats)
    hosts = HostCheck(config.allowed_hosts or default_allowed_hosts(config.host))
    warn_if_open(config, access, hosts)
    state = ServerContext(engine, config, access, gate, telemetry, Cors(config.cors_origins), hosts,
                          field_limits=config.field_limits,
                          tenants=TenantLimits(config.max_concurrent_per_key, config.max_queued_per_key,
                                               config.tokens_per_minute),
                          encoder_gate=AdmissionGate(config.max_queued_embedding_inputs,
                                                     config.max_queued_embedding_tokens, ENCODER_NAMES))
    app.extensions[_KEY] = state
    return state


def warn_if_open(config: ServerConfig, access: Access, hosts: HostCheck) -> None:
    """One log line when the server listens beyond this machine with no API keys: anyone who reaches the port
    is a client (docs/SECURITY.md, threat model)."""
    if access.keys or is_loopback(config.host):
        return
    allowed = "any Host ('*')" if hosts.any else ", ".join(sorted(hosts.allowed))
    log.warning("listening on %s with no API keys: any client that reaches the port may call every inference "
                "route; Host allow-list: %s; /admin/* answers %s (set --api-key / --admin-key, docs/SECURITY.md)",
                config.host, allowed, "every client (--admin-open)" if access.admin_open else "loopback clients only")


def server() -> ServerContext:
    """The running app's server state."""
    return current_app.extensions[_KEY]


def state_of(app: Any) -> ServerContext:
    """The server state attached to `app` (outside a request)."""
    return app.extensions[_KEY]


def model_name(state: ServerContext) -> str:
    """The served name; before the model is loaded, the basename of what was asked for (as the loader
    will name it: hub.resolve_model)."""
    try:
        name = state.engine.served_name
    except Exception:  # a loading engine cannot say yet
        name = None
    if name:
        return name
    asked = str(getattr(state.config.engine, "model", None) or "model")
    return Path(asked).name


def model_status(state: ServerContext) -> tuple[str, bool]:
    """(model name, loaded and serving)."""
    return model_name(state), state.engine.state == "ready"


def readiness() -> tuple[bool, str]:
    """(ready, code): whether a generation request is taken now, and else why not."""
    state = server()
    if state.draining:
        return False, "draining"
    engine_state = state.engine.state
    if state.models is not None and state.models.swapping_to is not None:
        return False, "swapping"
    if engine_state == "ready":
        return True, "ready"
    if engine_state == "no_model":
        return False, "no_model"
    if engine_state in ("loading", "warming_up"):
        return False, "loading"
    if engine_state == "faulted":
        return False, "engine_faulted"
    if engine_state == "suspended":
        return False, "suspended"
    return False, "stopped"


def ready_engine() -> Engine:
    """The engine, or why it cannot take a request now: a 503 while that may pass (loading, draining),
    a 500 `engine_faulted` after a device fault (as the request that hit it got: retrying a dead
    engine does not help; restart the process)."""
    ready, code = readiness()
    if not ready:
        if code == "engine_faulted":
            raise ImpError("the engine faulted; restart the server", code=code, status=500)
        messages = {"loading": "the model is still loading", "draining": "the server is shutting down",
                    "swapping": "another model is being loaded; retry shortly",
                    "no_model": "no model is loaded: name one of /v1/models in a request or POST /admin/models/load",
                    "suspended": "the engine is suspended; POST /admin/resume", "stopped": "the engine stopped"}
        raise unavailable(messages[code], code)
    return server().engine


async def _bounded_body() -> bytes:
    """The request body: 413 past the body limit (a chunked body has no Content-Length for the access check)."""
    body = await request.get_data()
    limit = server().body_limit()
    if len(body) > limit:
        raise ImpError(f"the request body has {len(body)} bytes; this server takes at most {limit}",
                       code="request_too_large", status=413)
    return body


async def parse_body(cls: type[M]) -> M:
    """The request body as `cls`, parsed off the event loop: 413 past the body limit, 400 if it is not one."""
    body = await _bounded_body()
    return await limits.off_loop(lambda: parse_model(cls, parse_json(body)))


async def json_body() -> dict[str, Any]:
    """A JSON object body (the admin routes'), held to the same limit and parsed off the event loop."""
    body = await _bounded_body()
    return await limits.off_loop(parse_json, body)


@dataclasses.dataclass(frozen=True)
class RequestContext:
    """What the request builder resolved for one request beside its body, handed on explicitly: the engine
    it runs on and the engine request's per-request fields, so that request is built once, whole
    (generation_request), by whichever dialect serves it. A --models-dir lease on the engine is not here: it is
    app.py's teardown hook's to release (g.model_lease), also for a request that fails before it has a context."""

    engine: Engine
    response_id: str | None = None   # the id its reply carries (new_id); public once the engine request is built
    session_id: str | None = None    # the body's session_id (session_id_of), as the client named it
    lora: str | None = None          # the adapter asked for by `lora`, or by `model` (vLLM's spelling)
    speculative: tuple[bool | None, int | None, int | None] = (None, None, None)   # validation.speculative_of
    cache_salt: str | None = None    # the prefix-cache partition (cache_salt)
    tenant: str | None = None        # who asked (access.tenant_of): the scheduler's fair share and per-key counts

    @property
    def model(self) -> str:
        """The `model` a generation's response names: the LoRA adapter the request asked for (as vLLM echoes an
        adapter's name), else the served model."""
        return self.lora or self.engine.served_name

    def generation_request(self, prompt_ids: list[int], params: SamplingParams, **fields: Any) -> GenerationRequest:
        """The engine request under response_id, with this request's session, adapter, speculation, cache
        partition and tenant; `fields` are the dialect's (priority, constraint, images, ...). Its id becomes the
        one X-Request-Id and the request log carry (set_response_id)."""
        set_response_id(self.response_id)
        switch, ngram_k, mtp_k = self.speculative
        return GenerationRequest(self.response_id, prompt_ids, params,
                                 session_id=engine_session_id(self.session_id, self.cache_salt), lora=self.lora,
                                 cache_salt=self.cache_salt, tenant=self.tenant, speculative=switch,
                                 spec_ngram_k=ngram_k, spec_mtp_k=mtp_k, **fields)


async def engine_request(cls: type[M], new_id: Callable[[], str] | None = None) -> tuple[M, RequestContext]:
    """The request body as `cls` (400 if it is not) and its RequestContext: the ready engine (503 if not), a
    404 unless the body's `model`, when it names one, is the model served here (or a loaded adapter), the
    body's per-request fields checked, and with `new_id` the id of the response to come."""
    req = await parse_body(cls)
    state = server()
    refuse_not_yet(req)
    check_fields(req, request.path)
    check_priority(req, granted("priority"))
    check_pins(req)
    session_id, lora, speculative = session_id_of(req), lora_of(req), speculative_of(req)
    model = getattr(req, "model", None)
    refuse_encoder_model(model, request.path)   # an embedding / rerank model's name: a 400 naming it
    if state.models is not None and model is not None and not state.draining and state.models.offers(state, model):
        await state.models.ensure(state, model, may_swap(state))   # swaps first if another model is loaded
        g.model_lease = state.models   # released at the request's teardown (app.py)
        engine = ready_engine()   # the readiness codes (suspended, engine_faulted, ...) apply here too
    else:
        engine = ready_engine()
        if model is not None and model != engine.served_name and is_adapter(engine, model):
            lora = lora or model   # vLLM's spelling: the adapter's name as the model
        elif model is not None:
            check_model_name(model, engine.served_name)
    limits.PROMPT_CHARS.set(state.prompt_chars(engine))
    for field in ("messages", "input"):   # more messages than the context has tokens cannot fit
        limits.check_count(getattr(req, field, None), int(engine.max_model_len), field)
    tenant = tenant_of(request.headers, request.remote_addr, bool(state.access.keys))
    return req, RequestContext(engine, new_id() if new_id is not None else None, session_id, lora, speculative,
                               cache_salt(), tenant)


def cache_salt() -> str | None:
    """The prefix-cache partition of this request: with API keys, its key's digest (so cached_tokens and
    timing cannot tell one key whether another sent a prompt), unless --shared-prefix-cache; else None."""
    state = server()
    key = presented_key(request.headers)
    if not state.access.keys or not key or state.config.shared_prefix_cache:
        return None
    return "key:" + key_digest(key)


def engine_session_id(session_id: str | None, salt: str | None) -> str | None:
    """The engine's name for a client's `session_id`: within its key's namespace when the cache is
    partitioned per key (`salt`: cache_salt), so another key cannot replace or close its pins."""
    return f"{salt}/{session_id}" if session_id is not None and salt is not None else session_id


MAX_SESSION_ID = 256


def granted(grant: str) -> bool:
    """Whether the current request may ask for `grant` (config.GRANTS): to every client by the server's
    flag (--client-priority; --client-pins all, or auto without API keys), else to keys granted it in
    --api-key-file."""
    state = server()
    config = state.config
    if grant == "priority" and config.client_priority:
        return True
    if grant == "pins" and (config.client_pins == "all" or (config.client_pins == "auto" and not state.access.keys)):
        return True
    return grant in state.access.keys.grants(presented_key(request.headers))


def may_swap(state: ServerContext) -> bool:
    """Whether this request may swap the --models-dir model (models_dir.ModelDirectory): an admin caller's
    may, anyone's with --swap-on-request."""
    return state.config.swap_on_request or state.access.is_admin(request.headers, request.remote_addr)


def check_priority(req: Any, allowed: bool) -> None:
    """A `priority` below the default (0: lower is served first) is the operator's to grant
    (--client-priority, or a key's 'priority' grant); without it such a request is a 400 naming the field."""
    priority = getattr(req, "priority", None)
    if isinstance(priority, int) and priority < 0 and not allowed:
        raise InvalidRequestError("'priority' below 0 (ahead of other clients) needs the server's "
                                  "--client-priority or a key granted 'priority'; send 0 or more",
                                  param="priority")


def check_pins(req: Any) -> None:
    """`cache_prompt: true` and `session_id` hold KV blocks against eviction, which other clients' requests
    then cannot use: the operator's to grant (--client-pins, a key's 'pins' grant). Without it they are a
    400 naming the field; Anthropic `cache_control` (a hint in Anthropic's API too) is served without
    pinning instead (pins_granted)."""
    for field in ("cache_prompt", "session_id"):
        if getattr(req, field, None) and not granted("pins"):
            raise InvalidRequestError(f"'{field}' pins KV blocks, which needs the server's --client-pins or a key "
                                      f"granted 'pins'", param=field, code="not_granted")


def session_id_of(req: Any) -> str | None:
    """The body's `session_id` (every dialect; runtime/scheduling/sessions.py), checked: a non-empty string."""
    sid = getattr(req, "session_id", None)
    if sid is None:
        return None
    if not isinstance(sid, str) or not 0 < len(sid) <= MAX_SESSION_ID:
        raise InvalidRequestError(f"'session_id' must be a string of 1 to {MAX_SESSION_ID} characters",
                                  param="session_id")
    return sid


def set_response_id(response_id: str) -> None:
    """The id a generation response carries in X-Request-Id when the client sent none (and the request log's id)."""
    g.response_id = response_id   # app.py's hooks: X-Request-Id and the error envelope
    state, owner = server(), caller_owner()
    _remember(state.id_owners, response_id, owner)
    client_id = g.get("client_request_id")
    if client_id:
        _remember(state.client_ids, (owner, client_id), response_id)
    record = g.get("record")
    if record is not None:
        record.server_id = response_id


def _remember(ids: OrderedDict[Any, Any], key: Any, value: Any) -> None:
    """`ids[key] = value` as the newest entry, the oldest forgotten past MAX_CLIENT_IDS."""
    ids[key] = value
    ids.move_to_end(key)
    while len(ids) > MAX_CLIENT_IDS:
        ids.popitem(last=False)


def caller_owner() -> str | None:
    """Who owns what this request creates (stored responses, request ids): its API key's digest; None
    without keys (every client the same owner)."""
    key = presented_key(request.headers)
    return key_digest(key) if server().access.keys and key else None


def default_max_tokens(asked: int | None, prompt_len: int, max_model_len: int) -> int | None:
    """`asked`, or when the request set none, `--max-tokens` cut to the context left (None: all of it)."""
    if asked is not None:
        return asked
    default = server().config.max_tokens
    return None if default is None else min(default, max_model_len - prompt_len)
