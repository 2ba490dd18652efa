"""What one request may make the server do before it reaches the engine (docs/SECURITY.md).

The request's JSON, the chat template and the tokenizer run before admission and its queue caps, so
they are bounded here by the context a request could fill: a prompt longer than `max_model_len`
tokens is refused anyway, so text past CHARS_PER_TOKEN characters per token of context is refused
before it is tokenized, and a conversation with more messages than the context has tokens cannot
fit either. Parsing, rendering and tokenizing run on worker threads (`off_loop`), so a large request
does not hold the event loop that streams every other response and answers /health.
"""
from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from imp_jax.errors import InvalidRequestError

T = TypeVar("T")
# The current request's prompt_chars (set by context.engine_request; copied into off_loop's threads).
PROMPT_CHARS: contextvars.ContextVar[int | None] = contextvars.ContextVar("prompt_chars", default=None)

CHARS_PER_TOKEN = 32              # text per token of context a prompt may hold (tokens average ~4 chars)
MIN_PROMPT_CHARS = 1 << 16        # however small the context
BYTES_PER_PROMPT_CHAR = 8         # body bytes per prompt character: JSON escapes, tools, message framing
MIN_REQUEST_BYTES = 4 << 20       # however small the context
DEFAULT_REQUEST_BYTES = 64 << 20  # while no model is loaded (the context is not known yet)


@dataclasses.dataclass(frozen=True)
class FieldLimits:
    """Limits on lists and strings a client sends (ServerConfig's --max-stop-strings etc. set them per
    server; FIELD_LIMITS carries them into the request's validators, on the loop and in off_loop)."""

    stop_strings: int = 16           # `stop` / `stop_sequences` entries
    stop_chars: int = 1024           # characters of one stop string (the stream holds back that much text)
    stop_token_ids: int = 128        # stop_token_ids entries (each sequence checks them at every token)
    tools: int = 256                 # tool definitions
    constraint_bytes: int = 64 << 10  # a schema (as compact JSON), regex, grammar or the choices together
    json_depth: int = 64             # arrays and objects nested in a body (recursive code past it could
                                     # exhaust the stack)


FIELD_LIMITS: contextvars.ContextVar[FieldLimits] = contextvars.ContextVar("field_limits", default=FieldLimits())


def field_limits() -> FieldLimits:
    """The current request's FieldLimits (the defaults outside a request)."""
    return FIELD_LIMITS.get()


def max_prompt_chars(configured: int | None, max_model_len: int | None) -> int:
    """Characters of text one request may hand the tokenizer: --max-prompt-chars, else derived."""
    if configured:
        return configured
    if not max_model_len:
        return DEFAULT_REQUEST_BYTES // BYTES_PER_PROMPT_CHAR
    return max(MIN_PROMPT_CHARS, CHARS_PER_TOKEN * max_model_len)


def max_request_bytes(configured: int | None, configured_chars: int | None, max_model_len: int | None) -> int:
    """The body limit: --max-request-bytes, else derived from the prompt limit."""
    if configured:
        return configured
    if not max_model_len and not configured_chars:
        return DEFAULT_REQUEST_BYTES
    return max(MIN_REQUEST_BYTES, BYTES_PER_PROMPT_CHAR * max_prompt_chars(configured_chars, max_model_len))


def check_chars(text: str, param: str, limit: int | None = None) -> None:
    """400 when `text` (a prompt, rendered chat or /tokenize input) is longer than `limit` characters
    (default: the current request's, PROMPT_CHARS)."""
    limit = limit if limit is not None else PROMPT_CHARS.get()
    if limit is not None and len(text) > limit:
        raise InvalidRequestError(
            f"'{param}' makes {len(text)} characters of prompt text; this server takes at most {limit} "
            f"(--max-prompt-chars; {CHARS_PER_TOKEN} per token of the model's context by default)",
            code="prompt_too_long", param=param)


def check_count(items: Any, limit: int, param: str) -> None:
    """400 when a client list (messages, input items) is longer than `limit`."""
    if isinstance(items, list) and len(items) > limit:
        raise InvalidRequestError(f"'{param}' has {len(items)} entries; at most {limit} fit the model's context",
                                  code="too_many_items", param=param)


async def off_loop(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run `fn` on a worker thread (with this context), so the event loop keeps serving other requests."""
    return await asyncio.to_thread(functools.partial(fn, *args, **kwargs))


SLICE_CHARS = 1 << 16   # JSON text one serialising call writes at most, about a millisecond of holding the GIL


async def json_reply(build: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`build(*args, **kwargs)` as a JSON response, built and serialised on a worker thread (`off_loop`),
    in slices (`json_pieces`), sent as those pieces: json's C encoder holds the GIL for a whole call, and
    so does joining, concatenating or encoding one large string, so a reply of a million items written
    at once (a tokenization with pieces, thousands of embeddings, logprobs of a long prompt) would stall
    the event loop from another thread as surely as on the loop itself. The bytes are the app's
    `jsonify`'s (its JSON provider: sorted keys, compact, ASCII), with a Content-Length."""
    from quart import current_app

    provider = current_app.json

    def run() -> Any:
        dumps = functools.partial(provider.dumps, separators=(",", ":"))
        chunks = [piece.encode() for piece in json_pieces(build(*args, **kwargs), dumps)] + [b"\n"]
        response = current_app.response_class(chunks, mimetype=provider.mimetype)
        response.content_length = sum(len(c) for c in chunks)
        return response

    return await off_loop(run)


def json_pieces(value: Any, dumps: Callable[[Any], str]) -> Iterator[str]:
    """`dumps(value)` as consecutive pieces, none much past SLICE_CHARS: dicts and short lists are walked, a
    long list is written in runs of items, each run sized from the characters per item of the run before
    (the first from the largest of the first few items: prompt_logprobs start with a bare null)."""
    if isinstance(value, dict):
        yield "{"
        for i, (k, v) in enumerate(sorted(value.items(), key=lambda kv: str(kv[0]))):
            yield f"{',' if i else ''}{dumps(str(k))}:"
            yield from json_pieces(v, dumps)
        yield "}"
    elif not isinstance(value, list):
        yield dumps(value)
    elif len(value) <= 64:
        yield "["
        for i, v in enumerate(value):
            if i:
                yield ","
            yield from json_pieces(v, dumps)
        yield "]"
    else:
        per = max(1, SLICE_CHARS // max(len(dumps(v)) for v in value[:8]))
        yield "["
        i = 0
        while i < len(value):
            run = dumps(value[i:i + per])[1:-1]
            yield ("," if i else "") + run
            i, per = i + per, max(1, SLICE_CHARS * per // max(1, len(run)))
        yield "]"
