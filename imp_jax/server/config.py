"""ServerConfig: the server's own settings; each field is a flag (`--rate-limit`) and a `--config` key."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from imp_jax.runtime.request import StreamLimits
from imp_jax.server.images import ImageLimits
from imp_jax.server.limits import FieldLimits

OTLP_PROTOCOLS = ("http/json", "http/protobuf")
DEFAULT_SERVICE_NAME = "imp-server"   # imp's server.otlp_service_name default
SCOPES = frozenset({"inference", "admin"})   # the routes a key may call; `admin` includes `inference`
GRANTS = SCOPES | {"priority", "pins"}   # what an API key may be granted (docs/SECURITY.md)


def _field(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata={"help": help, **kw})
    return dataclasses.field(default=default, metadata={"help": help, **kw})


@dataclasses.dataclass
class ServerConfig:
    """Server-side settings; `engine` is the engine's own config (EngineConfig), shown by /props and /info."""

    host: str = _field("127.0.0.1", "address to listen on")
    port: int = _field(8080, "port to listen on (0 picks a free one)")
    log_level: str = _field("info", "log level", choices=("debug", "info", "warning", "error"))
    ui: bool = _field(True, "serve the built-in chat page at GET / (--no-ui: off; docs/UI.md)")
    responses_store_ttl_s: float = _field(24 * 3600.0, "seconds a stored /v1/responses answer lives")
    responses_store_max_entries: int = _field(4096, "stored responses kept")
    responses_store_max_bytes: int = _field(64 * 1024 * 1024, "bytes of stored responses kept")
    # access
    api_key: list[str] = _field([], "an accepted API key, granted 'inference' only (repeatable); with any key "
                                    "set, every route but /health and /ready needs one")
    admin_key: list[str] = _field([], "an accepted API key granted 'admin' (/admin/* routes and model swaps) "
                                      "besides 'inference'")
    api_key_file: str | None = _field(None, "a file of accepted API keys, one per line ('#' starts a comment); "
                                            "a key may be followed by its grants: 'inference' (the default), "
                                            "'admin', 'priority', 'pins' (docs/SECURITY.md)")
    admin_open: bool = _field(False, "without API keys, answer /admin/* routes (and model swaps) from any "
                                     "client address, not only loopback ones")
    metrics_public: bool = _field(False, "serve /metrics without an API key")
    rate_limit: int = _field(0, "requests per minute per API key (per client address without keys); 0 = off")
    cors_origins: list[str] = _field([], "origins a browser may call from (repeatable or comma-separated; "
                                         "'*' = any); none: CORS off")
    allowed_hosts: list[str] = _field([], "Host header names accepted, any port (repeatable or comma-separated; "
                                          "'*' = any); default: loopback names when --host is a loopback "
                                          "address, else any (docs/SECURITY.md)")
    client_priority: bool = _field(False, "let every client ask for a 'priority' below 0 (served ahead of "
                                          "others); off: only keys granted 'priority' may, others get a 400")
    client_pins: str = _field("auto", "who may pin KV blocks (cache_prompt, session_id, Anthropic cache_control): "
                                      "'all'; 'granted' (keys granted 'pins' in --api-key-file); 'auto' (all "
                                      "when the server has no API keys, else 'granted')",
                              choices=("auto", "all", "granted"))
    shared_prefix_cache: bool = _field(False, "with API keys, share the prefix cache between keys (by default "
                                              "each key has its own: a cache hit would tell one key another's "
                                              "prompt)")
    auth_failures_per_minute: int = _field(20, "failed API-key attempts per minute per client address; past "
                                                "them the address gets 429 before its key is checked, a valid "
                                                "one too, until the minute passes (with keys set); 0 = off")
    # limits
    max_request_bytes: int | None = _field(None, "largest request body in bytes (413 past it); default: 8 per "
                                                 "character of --max-prompt-chars, at least 4 MiB (64 MiB "
                                                 "while no model is loaded)")
    max_prompt_chars: int | None = _field(None, "characters of prompt text (a raw prompt, a rendered chat, "
                                                "/tokenize input) one request may have tokenized (400 past "
                                                "it); default: 32 per token of the model's context")
    max_stop_strings: int = _field(16, "stop strings per request (400 past it)")
    max_stop_chars: int = _field(1024, "characters of one stop string (400 past it)")
    max_stop_token_ids: int = _field(128, "stop_token_ids per request (400 past it)")
    max_tools: int = _field(256, "tool definitions per request (400 past it)")
    max_constraint_bytes: int = _field(64 << 10, "bytes of one output constraint: a JSON schema, regex, grammar "
                                                 "or the choices together (400 past it)")
    max_json_depth: int = _field(64, "levels arrays and objects may nest in a request body (400 past it)")
    max_image_bytes: int = _field(20 << 20, "encoded bytes of one image content part (400 past it)")
    max_images_per_request: int = _field(16, "images per request, client video frames included (400 past it)")
    max_image_pixels: int = _field(33_177_600, "width x height of one image, read from its header before it is "
                                               "decoded (400 past it); default 8K UHD, 7680 x 4320")
    max_video_frames: int = _field(32, "frames of one client video content part (400 past it)")
    allow_image_urls: bool = _field(False, "fetch http(s) image URLs in content parts (off: a 400; only inline "
                                           "data: URLs are taken); the server then GETs any URL a client names "
                                           "(docs/SECURITY.md)")
    max_queued_requests: int = _field(0, "generation requests waiting for their first token at most "
                                         "(429 past it); 0 = no limit")
    max_queued_tokens: int = _field(0, "prompt tokens of the requests waiting for their first token at most "
                                       "(429 past it); 0 = no limit")
    max_concurrent_per_key: int = _field(0, "generation requests in flight per API key (per client address "
                                            "without keys) at most (429 past it); 0 = no limit")
    max_queued_per_key: int = _field(0, "generation requests per API key (per client address without keys) "
                                        "waiting for their first token at most (429 past it); 0 = no limit")
    tokens_per_minute: int = _field(0, "prompt + generated tokens per minute per API key (per client address "
                                       "without keys): a bucket of this many, refilled at this rate; prompts are "
                                       "charged at admission, output at the end; a caller in debt gets 429 until it "
                                       "refills; 0 = off")
    max_queued_embedding_inputs: int = _field(0, "inputs of /v1/embeddings and /v1/rerank requests queued or "
                                                 "running on the encoders at most (429 past it); 0 = no limit")
    max_queued_embedding_tokens: int = _field(0, "tokens of those inputs at most (429 past it); 0 = no limit")
    request_timeout: float = _field(0.0, "seconds after which a generation request ends with what it has "
                                         "(finish_reason length); 0 = never")
    max_tokens: int | None = _field(None, "default max_tokens of a request that sets none (default: what is "
                                          "left of the context)")
    stream_buffer_events: int = _field(256, "events buffered per request for a client that reads slowly")
    stream_stall_timeout: float = _field(30.0, "seconds a full event buffer may go unread before the "
                                               "client is dropped")
    # observability
    models_dir: str | None = _field(None, "a directory of models (.gguf files, HF or converted directories) "
                                    "listed on /v1/models; a request naming one swaps to it (--swap-on-request, "
                                    "--swap-min-seconds)")
    swap_timeout: float = _field(300.0, "seconds a model swap waits for the current model's in-flight requests")
    swap_on_request: bool = _field(False, "let any client's request naming another --models-dir model swap to it; "
                                          "off: only admin callers' requests swap, others get a 403 naming 'model'")
    swap_min_seconds: float = _field(30.0, "seconds a model serves before a request may swap it out (503 with "
                                           "Retry-After sooner); POST /admin/models/load is not held to it")
    lora_dir: str | None = _field(None, "the directory POST /admin/lora/load may read adapters from (a 'path' "
                                        "must resolve inside it); unset: only the start-up --lora paths load")
    drain_timeout: float = _field(30.0, "seconds SIGTERM waits for in-flight requests to finish (new ones get "
                                  "503 draining meanwhile) before the server exits")
    log_requests: str | None = _field(None, "append one JSON line per request to this file")
    otlp_endpoint: str | None = _field(None, "OTLP/HTTP traces URL of a collector "
                                             "(http://host:4318/v1/traces): export a span per generation request")
    otlp_service_name: str | None = _field(None, "service.name of the exported spans; default "
                                                 "$OTEL_SERVICE_NAME, else imp-server (imp's)")
    otlp_protocol: str = _field("http/json", "OTLP/HTTP encoding of the exported spans: http/json (imp's) or "
                                             "http/protobuf", choices=OTLP_PROTOCOLS)
    # encoder models beside the chat model (docs/API.md, embeddings and rerank)
    embedding_model: str | None = _field(None, "an embedding model (HF BERT-family directory or alias, e.g. "
                                         "all-minilm-l6-v2, or a llama.cpp BERT .gguf) served on /v1/embeddings and /v1/rerank beside the "
                                         "chat model; a cross-encoder here is taken as the rerank model")
    rerank_model: str | None = _field(None, "a cross-encoder (HF *ForSequenceClassification directory, 1 label) "
                                      "served on /v1/rerank")
    encoder_max_batch: int = _field(32, "inputs in one encoder program call at most (batched across clients)")
    engine: Any = dataclasses.field(default=None, metadata={"flag": False})
    model_given: bool = dataclasses.field(default=True, metadata={"flag": False})  # --model set (cli.parse_config)

    def __post_init__(self) -> None:
        if isinstance(self.api_key, str):
            self.api_key = [self.api_key]
        if isinstance(self.admin_key, str):
            self.admin_key = [self.admin_key]
        if isinstance(self.cors_origins, str):
            self.cors_origins = [self.cors_origins]
        self.cors_origins = [o.strip() for v in self.cors_origins for o in v.split(",") if o.strip()]
        if isinstance(self.allowed_hosts, str):
            self.allowed_hosts = [self.allowed_hosts]
        self.allowed_hosts = [h.strip() for v in self.allowed_hosts for h in v.split(",") if h.strip()]
        for name in ("rate_limit", "max_queued_requests", "max_queued_tokens", "request_timeout", "drain_timeout",
                     "swap_min_seconds", "auth_failures_per_minute", "max_concurrent_per_key", "max_queued_per_key",
                     "tokens_per_minute", "max_queued_embedding_inputs", "max_queued_embedding_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_request_bytes", "max_prompt_chars"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("stream_buffer_events", "stream_stall_timeout", "max_stop_strings", "max_stop_chars",
                     "max_stop_token_ids", "max_tools", "max_constraint_bytes", "max_json_depth", "max_image_bytes",
                     "max_images_per_request", "max_image_pixels", "max_video_frames"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.encoder_max_batch < 1:
            raise ValueError(f"encoder_max_batch must be >= 1, got {self.encoder_max_batch}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.otlp_protocol not in OTLP_PROTOCOLS:
            raise ValueError(f"otlp_protocol must be one of {', '.join(OTLP_PROTOCOLS)}, got {self.otlp_protocol!r}")
        if not self.otlp_service_name:
            self.otlp_service_name = os.environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME
        if self.otlp_endpoint is not None and not self.otlp_endpoint.startswith(("http://", "https://")):
            raise ValueError(f"otlp_endpoint must be an http:// or https:// URL, got {self.otlp_endpoint!r}")

    @property
    def field_limits(self) -> FieldLimits:
        return FieldLimits(self.max_stop_strings, self.max_stop_chars, self.max_stop_token_ids, self.max_tools,
                           self.max_constraint_bytes, self.max_json_depth)

    @property
    def image_limits(self) -> ImageLimits:
        return ImageLimits(self.max_image_bytes, self.max_images_per_request, self.max_image_pixels,
                           self.max_video_frames, self.allow_image_urls)

    @property
    def stream_limits(self) -> StreamLimits:
        return StreamLimits(max_events=self.stream_buffer_events, stall_timeout_s=self.stream_stall_timeout)

    def api_keys(self) -> list[str]:
        """The keys from --api-key and --api-key-file (read now; a missing file is a ValueError)."""
        return list(self.api_key_grants())

    def api_key_grants(self) -> dict[str, frozenset[str]]:
        """Each key with its grants: a key-file line is `KEY [GRANT ...]` (GRANTS; an unknown one is a
        ValueError); every key has `inference`, --admin-key keys and key-file lines naming `admin` have
        `admin` too."""
        keys: dict[str, frozenset[str]] = {k: frozenset({"inference"}) for k in self.api_key if k}
        for k in self.admin_key:
            if k:
                keys[k] = keys.get(k, frozenset()) | {"admin", "inference"}
        if not self.api_key_file:
            return keys
        try:
            lines = Path(self.api_key_file).read_text().splitlines()
        except OSError as e:
            raise ValueError(f"api_key_file {self.api_key_file}: {e}") from None
        for number, line in enumerate(lines, 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            key, grants = words[0], frozenset(words[1:])
            if grants - GRANTS:
                raise ValueError(f"api_key_file {self.api_key_file} line {number}: unknown grant "
                                 f"{sorted(grants - GRANTS)[0]!r} (grants: {', '.join(sorted(GRANTS))})")
            # every key may infer: a line naming no scope (as before scopes existed) and `admin` alike
            keys[key] = keys.get(key, frozenset()) | grants | {"inference"}
        return keys


def flag_fields() -> list[dataclasses.Field]:
    """The fields that are flags (all but `engine`)."""
    return [f for f in dataclasses.fields(ServerConfig) if f.metadata.get("flag", True)]
