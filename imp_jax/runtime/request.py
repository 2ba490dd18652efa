"""What goes into the engine (GenerationRequest, SamplingParams) and what comes out (EngineEvent)."""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import numpy as np

from imp_jax.errors import InvalidRequestError
from imp_jax.runtime.decoding.banned import check_phrases
from imp_jax.runtime.decoding.dry import (
    DEFAULT_BREAKERS,
    MAX_BREAKER_CHARS,
    MAX_BREAKERS,
    MAX_DRY_BASE,
    MAX_DRY_MULTIPLIER,
    DryParams,
)
from imp_jax.runtime.replies.calls import ParseEvent

# Request limits: the engine checks them (SamplingParams.validate, check_context) and the server's
# dialects check the same values, from here, before a request reaches it.
MAX_N = 4
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 64                     # entries per request (a static width of the compiled sampler)
LOGIT_BIAS_RANGE = (-100.0, 100.0)
TOP_K_RANGE = (-(2**31), 2**31 - 1)     # <= 0 (or >= the vocabulary) is off
SEED_RANGE = (-(2**63), 2**64 - 1)
MAX_DRY_ALLOWED_LENGTH = 1024
MAX_CFG_SCALE = 10.0                    # cfg_scale in [1, MAX_CFG_SCALE], 1 = off (runtime/decoding/cfg.py)
MIROSTAT_TAU, MIROSTAT_ETA = 5.0, 0.1   # llama.cpp's defaults (runtime/execution/mirostat.py)
MAX_MIROSTAT_TAU = 100.0                # bits: far past any vocabulary's entropy


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int, prompt_param: str) -> None:
    """400 when the prompt is empty, or it or the prompt plus max_tokens does not fit the context."""
    if prompt_len == 0:
        raise InvalidRequestError("the prompt is empty", param=prompt_param)
    if prompt_len >= max_model_len:
        raise InvalidRequestError(
            f"the prompt has {prompt_len} tokens; this model's context is {max_model_len} tokens "
            "and at least one must be left to generate", code="context_length_exceeded", param=prompt_param)
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds this model's "
            f"context of {max_model_len} tokens", code="context_length_exceeded", param="max_tokens")


# Logprob entries one reply may carry (a token and each of its top alternatives count one): ~100 bytes of
# JSON each, so about 400 MB at the cap; past it a 400 asks for fewer tokens, alternatives or choices.
MAX_REPLY_LOGPROBS = 1 << 22


def check_reply_size(params: "SamplingParams", prompt_len: int, max_tokens: int, lens_layers: int = 0) -> None:
    """400 naming the field when the logprobs a reply could carry (n choices, each with max_tokens tokens of
    1 + logprobs entries, and with `lens_layers` of 1 + logit_lens each; the prompt's 1 + prompt_logprobs per
    token) pass MAX_REPLY_LOGPROBS."""
    def per_token(top: int | None) -> int:
        return 0 if top is None else 1 + top
    generated = per_token(params.logprobs) + lens_layers * per_token(params.logit_lens)
    entries = params.n * (max_tokens * generated + prompt_len * per_token(params.prompt_logprobs))
    if entries > MAX_REPLY_LOGPROBS:
        field = ("logit_lens" if lens_layers and params.logit_lens is not None
                 else "logprobs" if params.logprobs is not None else "prompt_logprobs")
        raise InvalidRequestError(
            f"the reply could carry {entries} logprob entries (n x tokens x (1 + top alternatives)); this server "
            f"sends at most {MAX_REPLY_LOGPROBS}: ask for fewer tokens (max_tokens), alternatives or choices (n)",
            code="response_too_large", param=field)


@dataclasses.dataclass
class SamplingParams:
    """Per-request generation knobs. None means "the model's default" (runtime/defaults.py)."""

    temperature: float | None = None      # 0 = greedy
    top_p: float | None = None            # 1 = off
    top_k: int | None = None              # <= 0 = off
    min_p: float | None = None            # 0 = off
    typical_p: float | None = None        # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None  # 1 = off
    seed: int | None = None
    max_tokens: int | None = None         # None: what is left of the context
    min_tokens: int = 0
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None           # None = off; k = the sampled token plus the top k
    prompt_logprobs: int | None = None    # None = off; k = each prompt token's raw logprob plus the top k
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # token ids whose raw model logprob (log_softmax of the unprocessed logits) every sampled token's
    # event reports (EngineEvent.raw_logprobs; /v1/score, /v1/decide); each takes a logit_bias slot
    raw_logprob_ids: list[int] = dataclasses.field(default_factory=list)
    logit_lens: int | None = None         # None = off; N = per layer, the sampled token's raw rank/logprob + top N
    # phrases the output must not contain: a completed one is rewound and resampled (runtime/decoding/banned.py)
    banned_strings: list[str] = dataclasses.field(default_factory=list)
    banned_regex: list[str] = dataclasses.field(default_factory=list)
    # mirostat v1 / v2 (runtime/execution/mirostat.py): 0 = off; tau and eta act only through it
    mirostat: int = 0
    mirostat_tau: float = MIROSTAT_TAU
    mirostat_eta: float = MIROSTAT_ETA
    # DRY (runtime/decoding/dry.py): multiplier 0 = off; the others act only through it
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1          # -1 = the context size, 0 = off
    dry_sequence_breakers: list[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_BREAKERS))

    @property
    def dry(self) -> DryParams:
        return DryParams(self.dry_multiplier, self.dry_base, self.dry_allowed_length, self.dry_penalty_last_n,
                         tuple(self.dry_sequence_breakers))

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequestError naming the first out-of-range field."""
        def bad(field: str, why: str) -> None:
            raise InvalidRequestError(f"'{field}' {why}", param=field)
        if self.temperature is not None and not 0 <= self.temperature <= 100:
            bad("temperature", "must be in [0, 100]")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if self.typical_p is not None and not 0 < self.typical_p <= 1:
            bad("typical_p", "must be in (0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                bad(name, "must be in [-2, 2]")
        if self.repetition_penalty is not None and not self.repetition_penalty > 0:
            bad("repetition_penalty", "must be > 0")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", "must be >= 1")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", "must be in [0, max_tokens]")
        if not 1 <= self.n <= MAX_N:
            bad("n", f"must be in [1, {MAX_N}]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            bad("logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]")
        if self.top_k is not None and not TOP_K_RANGE[0] <= self.top_k <= TOP_K_RANGE[1]:
            bad("top_k", "must be a 32-bit integer (<= 0 is off)")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            bad("seed", "must fit in 64 bits")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            bad("logit_bias", f"has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
        for tok in self.raw_logprob_ids:
            if not 0 <= tok < vocab_size:
                bad("raw_logprob_ids", f"token id {tok} is outside the vocabulary [0, {vocab_size})")
        if len(set(self.logit_bias) | set(self.raw_logprob_ids)) > MAX_LOGIT_BIAS:
            bad("raw_logprob_ids", f"with logit_bias, at most {MAX_LOGIT_BIAS} distinct token ids")
        if self.logit_lens is not None and not 1 <= self.logit_lens <= MAX_TOP_LOGPROBS:
            bad("logit_lens", f"must be true or in [1, {MAX_TOP_LOGPROBS}]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            bad("prompt_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]")
        for tok, val in self.logit_bias.items():
            if not 0 <= tok < vocab_size:
                bad("logit_bias", f"token id {tok} is outside the vocabulary [0, {vocab_size})")
            if not LOGIT_BIAS_RANGE[0] <= val <= LOGIT_BIAS_RANGE[1]:
                bad("logit_bias", f"value {val} for token {tok} must be in [-100, 100]")
        for tok in self.stop_token_ids:
            if not 0 <= tok < vocab_size:
                bad("stop_token_ids", f"token id {tok} is outside the vocabulary")
        if any(not s for s in self.stop):
            bad("stop", "must not contain empty strings")
        if self.banned_strings or self.banned_regex:
            check_phrases(self.banned_strings, self.banned_regex)
        self._validate_dry(bad)
        if self.mirostat not in (0, 1, 2):
            bad("mirostat", "must be 0 (off), 1 or 2 (mirostat v1 / v2)")
        if self.mirostat and not (0 < self.mirostat_tau <= MAX_MIROSTAT_TAU and math.isfinite(self.mirostat_tau)):
            bad("mirostat_tau", f"must be in (0, {MAX_MIROSTAT_TAU:g}] (bits)")
        if self.mirostat and not 0 < self.mirostat_eta <= 1:
            bad("mirostat_eta", "must be in (0, 1]")

    def _validate_dry(self, bad: Any) -> None:
        if not 0 <= self.dry_multiplier <= MAX_DRY_MULTIPLIER:
            bad("dry_multiplier", f"must be in [0, {MAX_DRY_MULTIPLIER:g}] (0 = off)")
        if self.dry_multiplier > 0 and not 1 < self.dry_base <= MAX_DRY_BASE:
            bad("dry_base", f"must be in (1, {MAX_DRY_BASE:g}]")
        if not 0 <= self.dry_allowed_length <= MAX_DRY_ALLOWED_LENGTH:
            bad("dry_allowed_length", f"must be in [0, {MAX_DRY_ALLOWED_LENGTH}]")
        if self.dry_penalty_last_n < -1:
            bad("dry_penalty_last_n", "must be >= -1 (-1 = the context size, 0 = off)")
        breakers = self.dry_sequence_breakers
        if len(breakers) > MAX_BREAKERS:
            bad("dry_sequence_breakers", f"must hold at most {MAX_BREAKERS} strings")
        if any(not isinstance(b, str) or not 0 < len(b) <= MAX_BREAKER_CHARS for b in breakers):
            bad("dry_sequence_breakers", f"must be strings of 1 to {MAX_BREAKER_CHARS} characters")


@dataclasses.dataclass
class GenerationRequest:
    """A tokenised prompt plus how to continue it."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    priority: int = 0             # lower runs first
    cache_prompt: bool = False    # pin the prompt's full KV blocks until the request ends
    cache_prompt_tokens: int | None = None  # with cache_prompt: pin only the blocks within this prompt prefix
    session_id: str | None = None  # pin the conversation's blocks for the session's next turn (sessions.py)
    lora: str | None = None       # adapter name; keys the prefix cache
    cache_salt: str | None = None  # prefix-cache partition: only requests with the same salt share blocks
    tenant: str | None = None      # who asked (an API key's digest, else the client address): the scheduler's fair share
    constraint: str | None = None  # llguidance grammar every choice's output must follow (constraints.py)
    compiled_constraint: Any = None  # its CompiledGrammar (constraints.py), set before admission off the engine thread
    reasoning: bool = False        # split a thinking model's think block from the answer (reasoning.py)
    reasoning_budget: int | None = None  # reasoning tokens before the engine forces the block's end
    tool_calls: bool = False       # tools are offered: a harmony reply's calls come as values (EngineEvent.answer)
    cfg_scale: float = 1.0         # classifier-free guidance (runtime/decoding/cfg.py); 1 = off
    cfg_prompt_ids: list[int] | None = None  # the shadow prompt CFG guides away from (with cfg_scale != 1)
    speculative: bool | None = None  # draft and verify (runtime/decoding/speculative.py); None = the server's --speculative
    spec_ngram_k: int | None = None  # the n-gram drafter's depth for this request; None = --speculative-max-draft
    spec_mtp_k: int | None = None    # the MTP head depth asked for (there is none: > 0 is declined)
    images: tuple[ImageInput, ...] = ()  # in prompt order; prompt_ids hold each one's Engine.image_prompt text
    prepared_images: Any = None    # their encoder frames (runtime/features/images.py), made before admission off the engine thread

    def pinned_blocks(self, block_size: int) -> int | None:
        """How many leading full blocks cache_prompt pins (None: every full block of the prompt)."""
        return None if self.cache_prompt_tokens is None else self.cache_prompt_tokens // block_size


@dataclasses.dataclass(frozen=True, eq=False)
class ImageInput:
    """One decoded image of a request (server/images.py): RGB pixels, and a digest of them the prefix
    cache can key on (equal pixels, equal digest, whatever the encoding they came in)."""

    pixels: np.ndarray    # uint8 [height, width, 3], RGB (transparency composited over white)
    digest: bytes         # xxh3_128 of the pixels and their shape (16 bytes)
    format: str           # what it was sent as: PNG, JPEG, WEBP, GIF
    encoded: bytes = dataclasses.field(repr=False)   # as sent (after base64): what a stored conversation keeps
    detail: str = "auto"  # the client's detail hint: auto, low or high (OpenAI's)

    @property
    def encoded_bytes(self) -> int:
        return len(self.encoded)

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in pixels."""
        return int(self.pixels.shape[1]), int(self.pixels.shape[0])


@dataclasses.dataclass(frozen=True)
class StreamLimits:
    """How far a request's reader may fall behind its events before it is dropped (runtime/core/event_buffer.py)."""

    max_events: int = 256          # buffered events; past this, events coalesce
    stall_timeout_s: float = 30.0  # events left waiting this long, nothing taken, drop the reader


@dataclasses.dataclass
class LensLayer:
    """logit_lens: one layer's reading of the sampled token (runtime/decoding/logit_lens.py), of the raw distribution."""

    rank: int                       # 1 = the layer's most likely token
    logprob: float
    entropy: float                  # nats
    top: list[tuple[int, float]]    # (token id, logprob), best first


@dataclasses.dataclass
class TokenLogprob:
    """The sampled token's logprob and the top alternatives, of the processed distribution."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None   # 1 = the most likely token (set for prompt logprobs)
    lens: list[LensLayer] | None = None   # logit_lens: one per layer, first to last


@dataclasses.dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int = 0   # of completion_tokens: the think block's, markers included
    # speculative decoding (runtime/decoding/speculative.py): imp_spec_* counters when a verify step ran or a
    # drafter the request asked for was declined (imp_spec_declined, imp_spec_declined_detail)
    spec: dict[str, Any] | None = None


@dataclasses.dataclass
class EngineEvent:
    """One step's news for one sequence (`index` = choice index when n > 1).

    `finish_reason` is set on a sequence's last event (stop, length, cancelled, error);
    `usage` is set once, on the request's very last event, when `done` is True. Times are
    `time.monotonic()`: when the event was made, and when the scheduler first put the request
    into a batch (None while it has not).
    """

    request_id: str
    index: int = 0
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    reasoning_text: str = ""   # the think block's text (GenerationRequest.reasoning); `text` is the answer's
    # with GenerationRequest.tool_calls, a harmony reply's answer as values (runtime/replies/calls.py): its text
    # (`text` joins it) and its calls, in order; None when the engine does not read the calls (the server does)
    answer: list[ParseEvent] | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on index 0's first event; entry 0 is None
    raw_logprobs: dict[int, float] | None = None  # SamplingParams.raw_logprob_ids at this event's token
    finish_reason: str | None = None
    stop_reason: str | int | None = None   # the stop string or token id that ended it
    usage: Usage | None = None
    done: bool = False
    error: str | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    created_at: float = dataclasses.field(default_factory=time.monotonic)
    admitted_at: float | None = None
