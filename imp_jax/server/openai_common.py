"""What OpenAI's Chat and Completions requests share: sampling fields, their checks, usage, ids."""
from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import field_validator

from imp_jax.errors import ImpError, InvalidRequestError
from imp_jax.runtime.request import MAX_LOGIT_BIAS, SEED_RANGE, TOP_K_RANGE, SamplingParams, Usage
from imp_jax.server.errors import openai_error_body
from imp_jax.server.limits import field_limits
from imp_jax.server.streaming import sse
from imp_jax.server.validation import WireModel

MAX_USER_CHARS = 256         # `user` (a caller's end-user id)


def check_stop_strings(v: list[str]) -> None:
    """A ValueError (a 400 naming the field) for too many stop strings or one too long (FieldLimits)."""
    limits = field_limits()
    if len(v) > limits.stop_strings:
        raise ValueError(f"must hold at most {limits.stop_strings} strings (--max-stop-strings)")
    if any(isinstance(s, str) and len(s) > limits.stop_chars for s in v):
        raise ValueError(f"each stop string must be at most {limits.stop_chars} characters (--max-stop-chars)")


def new_id(prefix: str) -> str:
    """A fresh response id: `chatcmpl-…`, `cmpl-…`."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class StreamOptions(WireModel):
    include_usage: bool = False


class OpenAISampling(WireModel):
    """The sampling and scheduling fields common to /v1/chat/completions and /v1/completions."""

    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    typical_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: list[str] | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    best_of: int | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    priority: int | None = 0
    cache_prompt: bool | None = False
    user: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [v]
        if isinstance(v, list):
            check_stop_strings(v)
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, v: list[int] | None) -> list[int] | None:
        limit = field_limits().stop_token_ids
        if v is not None and len(v) > limit:
            raise ValueError(f"must hold at most {limit} token ids (--max-stop-token-ids)")
        return v

    @field_validator("user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        if v is not None and len(v) > MAX_USER_CHARS:
            raise ValueError(f"must be at most {MAX_USER_CHARS} characters")
        return v

    @field_validator("seed")
    @classmethod
    def _seed_range(cls, v: int | None) -> int | None:
        if v is not None and not SEED_RANGE[0] <= v <= SEED_RANGE[1]:
            raise ValueError("must be a 64-bit integer")
        return v

    def check_common(self) -> None:
        """The cross-field rules OpenAI enforces (SamplingParams.validate does the ranges)."""
        if self.best_of is not None and self.best_of != 1:
            raise InvalidRequestError("'best_of' must be 1: this server generates no candidate set to choose from",
                                      param="best_of")
        if self.top_k is not None and not TOP_K_RANGE[0] <= self.top_k <= TOP_K_RANGE[1]:
            raise InvalidRequestError("'top_k' must be a 32-bit integer (>= the vocabulary size is off)",
                                      param="top_k")
        if self.logit_bias and len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("'stream_options' is only allowed when 'stream' is true",
                                      param="stream_options")

    def banned(self, name: str) -> list[str]:
        """`banned_strings` / `banned_regex` (a body extra on every route): a list of strings, or null / absent;
        their limits are checked with the other fields (SamplingParams.validate)."""
        value = (self.model_extra or {}).get(name)
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise InvalidRequestError(f"'{name}' must be an array of strings", param=name)
        return list(value)

    def logit_bias_ids(self) -> dict[int, float]:
        """logit_bias with its token-id keys as ints."""
        out = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                out[int(key)] = value
            except ValueError:
                raise InvalidRequestError(f"'logit_bias' key {key!r} is not a token id", param="logit_bias") from None
        return out

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, vocab_size: int) -> SamplingParams:
        """The engine's SamplingParams, range-checked (a 400 naming the field)."""
        params = SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            typical_p=self.typical_p, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0, repetition_penalty=self.repetition_penalty,
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens or 0, stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=bool(self.ignore_eos),
            n=1 if self.n is None else self.n, logprobs=logprobs, logit_bias=self.logit_bias_ids(),
            skip_special_tokens=self.skip_special_tokens is not False,
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            banned_strings=self.banned("banned_strings"), banned_regex=self.banned("banned_regex"),
            **self._dry_fields(), **self._mirostat_fields(),
        )
        params.validate(vocab_size)
        return params

    def _dry_fields(self) -> dict[str, Any]:
        """The DRY fields the request sets (the others keep SamplingParams' llama.cpp defaults)."""
        names = ("dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def _mirostat_fields(self) -> dict[str, Any]:
        """The mirostat fields the request sets (the others keep llama.cpp's defaults: off, tau 5, eta 0.1)."""
        return {n: getattr(self, n) for n in ("mirostat", "mirostat_tau", "mirostat_eta") if getattr(self, n) is not None}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def usage_json(usage: Usage) -> dict[str, Any]:
    """OpenAI usage, with the prefix-cache hit in prompt_tokens_details.cached_tokens; evicted_tokens (imp:
    prompt tokens StreamingLLM eviction dropped) is always 0, as this server never evicts a running sequence's KV."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens, "evicted_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens, **(usage.spec or {})},
    }



class OpenAIStream:
    """Chunk framing shared by the chat and legacy completions stream formatters."""

    object_name = ""

    def __init__(self, rid: str, model: str, include_usage: bool):
        self._rid, self._model, self._include_usage = rid, model, include_usage
        self._created = now()

    def _chunk(self, choices: list[dict[str, Any]], usage: Usage | None = None) -> str:
        """One chunk; with include_usage every chunk carries `usage` (null until the last)."""
        body: dict[str, Any] = {"id": self._rid, "object": self.object_name, "created": self._created,
                                "model": self._model, "system_fingerprint": None, "choices": choices}
        if self._include_usage:
            body["usage"] = usage_json(usage) if usage is not None else None
        return sse(body)

    def open(self) -> list[str]:
        return []

    def close(self, usage: Usage | None) -> list[str]:
        frames = [self._chunk([], usage)] if self._include_usage and usage is not None else []
        return frames + [sse("[DONE]")]

    def error(self, err: ImpError) -> list[str]:
        return [sse(openai_error_body(err)), sse("[DONE]")]

    def ping(self) -> list[str]:
        return []
