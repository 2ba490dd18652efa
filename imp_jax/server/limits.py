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
from collections.abc import Callable
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
    in slices (`dumps_sliced`): json's C encoder holds the GIL for a whole call, so a reply of a million
    items serialised at once (a tokenization with pieces, thousands of embeddings, logprobs of a long
    prompt) would stall the event loop from another thread as surely as on the loop itself. The text is
    the app's `jsonify`'s (its JSON provider: sorted keys, compact, ASCII)."""
    from quart import current_app

    provider = current_app.json

    def run() -> Any:
        body = dumps_sliced(build(*args, **kwargs), functools.partial(provider.dumps, separators=(",", ":")))
        return current_app.response_class(body + "\n", mimetype=provider.mimetype)

    return await off_loop(run)


def dumps_sliced(value: Any, dumps: Callable[[Any], str]) -> str:
    """`dumps(value)`, written a slice at a time: dicts and short lists are walked, a long list is written
    in runs of items sized from its first item to about SLICE_CHARS each."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{dumps(str(k))}:{dumps_sliced(v, dumps)}"
                              for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))) + "}"
    if not isinstance(value, list):
        return dumps(value)
    if len(value) <= 64:
        return "[" + ",".join(dumps_sliced(v, dumps) for v in value) + "]"
    per = max(1, SLICE_CHARS // max(1, len(dumps(value[0]))))
    return "[" + ",".join(dumps(value[i:i + per])[1:-1] for i in range(0, len(value), per)) + "]"
