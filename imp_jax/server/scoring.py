"""Closed-choice scoring on the chat model, no decoding: `POST /v1/score` and `POST /v1/decide`.

Each request is one ordinary GenerationRequest of `max_tokens: 1` through the engine's normal
scheduler: batched with other clients' prefill and decode, on paged KV with the prefix cache, its
blocks freed when it ends. The candidate token ids ride in `SamplingParams.raw_logprob_ids`: the
engine gives each a logit_bias slot of bias 0 and the compiled sampler, which carries those slots
already, reports each slot's raw logprob (log_softmax of the unprocessed logits) beside the token it
samples. So the numbers are the model's own distribution at the position after the last prompt
token, whatever the sampling knobs (pinned neutral here all the same: greedy, no penalties, no
truncation), and no program is added: the step programs every request runs serve these too. The
sampled token is discarded and not counted as generated. (The prompt-logprobs path was the other
way in: it runs a prompt alone in the largest bucket, outside the batch, one target per position.)
"""
from __future__ import annotations

import math
import string
from typing import Any, ClassVar

from quart import Blueprint, g, jsonify

from imp_jax.errors import EngineError, InvalidRequestError
from imp_jax.runtime.api import Engine
from imp_jax.runtime.request import MAX_LOGIT_BIAS, SamplingParams, check_context
from imp_jax.server import fields
from imp_jax.server.chat_completions import ChatMessage, ContentPart
from imp_jax.server.context import RequestContext, engine_request
from imp_jax.server.dialect import Plan, run
from imp_jax.server.generation import collect
from imp_jax.server.limits import check_chars, off_loop
from imp_jax.server.openai_common import new_id, now
from imp_jax.server.prompts import text_chat_prompt
from imp_jax.server.validation import WireModel

bp = Blueprint("scoring", __name__)

MAX_CANDIDATES = MAX_LOGIT_BIAS   # each distinct candidate token takes one of the sampler's per-row id slots
LETTERS = string.ascii_uppercase  # /v1/decide: options A..Z
MIN_OPTIONS, MAX_OPTIONS = 2, len(LETTERS)
DECIDE_INSTRUCTION = "Answer with the letter of the correct option only."


class Scheduling(WireModel):
    """What a scoring request shares with generation: its queue priority (lower first) and cache_prompt
    (pin the prompt's KV blocks while it runs); the body keys every route reads (session_id, lora, ...)."""

    EXTRAS: ClassVar[frozenset[str]] = fields.ENGINE_EXTRAS
    HINTS: ClassVar[dict[str, str]] = {"temperature": "scores are the model's raw distribution, before sampling"}

    priority: int | None = 0
    cache_prompt: bool | None = False


class ScoreRequest(Scheduling):
    model: str
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    candidates: list[Any] | None = None   # strings or token ids, checked one by one (candidate_token)
    truncate: bool = False


class DecideRequest(Scheduling):
    model: str
    question: str | None = None
    messages: list[ChatMessage] | None = None
    options: list[str] | None = None
    system: str | None = None
    instructions: str | None = None   # = system (the Responses spelling)
    truncate: bool = False


# ----------------------------------------------------------------------------- prompts
def exactly_one(req: Any, first: str, second: str) -> str:
    """The one of two alternative fields the request sets (a 400 naming the field otherwise)."""
    given = [f for f in (first, second) if getattr(req, f) is not None]
    if len(given) != 1:
        why = "not both" if given else "one is required"
        raise InvalidRequestError(f"send exactly one of '{first}' or '{second}' ({why})",
                                  param=second if given else first)
    return given[0]


def chat_ids(messages: list[ChatMessage], tokenizer: Any) -> list[int]:
    """The conversation through the chat template with the generation prompt, tokenized."""
    if not messages:
        raise InvalidRequestError("'messages' must hold at least one message", param="messages")
    for i, m in enumerate(messages):
        if m.content is None:
            raise InvalidRequestError(f"'messages[{i}].content' is required", param=f"messages[{i}].content")
    return text_chat_prompt(messages, tokenizer)


def fit_context(ids: list[int], max_model_len: int, truncate: bool, param: str) -> tuple[list[int], bool]:
    """`ids` when they leave room for the one scored position; else with `truncate` their last
    max_model_len - 1 tokens, without it a 400 context_length_exceeded. Also whether it cut."""
    if truncate and len(ids) >= max_model_len:
        return ids[len(ids) - max_model_len + 1:], True
    check_context(len(ids), 1, max_model_len, param)
    return ids, False


def candidate_token(c: Any, i: int, tokenizer: Any, vocab_size: int) -> int:
    """A candidate's token: an id as given, a string's FIRST token (encoded alone, as given, no
    special tokens: a leading space is part of the string and BPE vocabularies tell it apart)."""
    param = f"candidates[{i}]"
    if isinstance(c, bool) or not isinstance(c, (str, int)):
        raise InvalidRequestError(f"'{param}' must be a string or a token id", param=param)
    if isinstance(c, int):
        if not 0 <= c < vocab_size:
            raise InvalidRequestError(f"'{param}': token id {c} is outside the vocabulary [0, {vocab_size})",
                                      param=param)
        return c
    if not c:
        raise InvalidRequestError(f"'{param}' must not be empty", param=param)
    check_chars(c, param)
    ids = tokenizer.encode(c, add_special_tokens=False, parse_special=False)
    if not ids:
        raise InvalidRequestError(f"'{param}' ({c!r}) tokenizes to nothing", param=param)
    return ids[0]


def decide_text(question: str, options: list[str]) -> str:
    """The user turn /v1/decide renders: the question, the lettered options, the instruction."""
    lines = [question, ""] + [f"{LETTERS[i]}. {o}" for i, o in enumerate(options)] + ["", DECIDE_INSTRUCTION]
    return "\n".join(lines)


def decide_messages(req: DecideRequest) -> list[ChatMessage]:
    """The conversation /v1/decide scores: [system] + the rendered question, or `messages` with the
    options and the instruction appended to its last (user) turn."""
    field = exactly_one(req, "question", "messages")
    options = req.options
    if options is None:
        raise InvalidRequestError("'options' is required", param="options")
    if not MIN_OPTIONS <= len(options) <= MAX_OPTIONS:
        raise InvalidRequestError(f"'options' must hold {MIN_OPTIONS} to {MAX_OPTIONS} strings, not {len(options)}",
                                  param="options")
    for i, o in enumerate(options):
        if not o.strip():
            raise InvalidRequestError(f"'options[{i}]' must not be empty", param=f"options[{i}]")
    if req.system is not None and req.instructions is not None:
        raise InvalidRequestError("send 'system' or 'instructions', not both", param="instructions")
    system = req.system if req.system is not None else req.instructions
    if field == "question":
        if not req.question.strip():
            raise InvalidRequestError("'question' must not be empty", param="question")
        head = [ChatMessage(role="system", content=system)] if system is not None else []
        return head + [ChatMessage(role="user", content=decide_text(req.question, options))]
    if system is not None:
        raise InvalidRequestError("'system' / 'instructions' go with 'question'; with 'messages' put a system "
                                  "message in them", param="system" if req.system is not None else "instructions")
    messages = list(req.messages)
    last = messages[-1] if messages else None
    if last is None or last.role != "user" or not last.text:
        raise InvalidRequestError("'messages' must end with a user message holding the question",
                                  param="messages")
    messages[-1] = last.model_copy(update={"content": [ContentPart(type="text", text=decide_text(last.text, options))]})
    return messages


# ------------------------------------------------------------------------------ engine
async def raw_logprobs(ctx: RequestContext, ids: list[int], token_ids: list[int],
                       req: Scheduling) -> tuple[dict[int, float], Any]:
    """One engine pass over `ids`: the raw logprob of each of `token_ids` at the next position, and usage;
    queued at the request's priority, its prompt pinned with cache_prompt."""
    params = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, typical_p=1.0, repetition_penalty=1.0,
                            max_tokens=1, raw_logprob_ids=list(dict.fromkeys(token_ids)))
    params.validate(ctx.engine.vocab_size)
    greq, events = await run(ctx, Plan(ids, params, fields={"priority": req.priority or 0,
                                                            "cache_prompt": bool(req.cache_prompt)}))
    result = await collect(ctx.engine, greq, events)
    g.record.completion_tokens = 0   # the one sampled token is discarded: nothing was generated
    raw = result.choices[0].raw_logprobs
    if set(raw) != set(params.raw_logprob_ids):
        raise EngineError("the engine did not report the candidates' logprobs")
    return raw, result.usage


def softmax(logprobs: list[float]) -> list[float]:
    """exp(l_i) / sum_j exp(l_j), in float64 (a -inf entry reads 0)."""
    top = max(logprobs)
    if top == -math.inf:
        return [1.0 / len(logprobs)] * len(logprobs)
    exps = [math.exp(lp - top) for lp in logprobs]
    total = sum(exps)
    return [e / total for e in exps]


def usage_json(usage: Any) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def distribution(raw: dict[int, float], token_ids: list[int]) -> dict[int, float]:
    """Softmax over the DISTINCT token ids (candidates sharing a first token share its probability)."""
    distinct = list(dict.fromkeys(token_ids))
    return dict(zip(distinct, softmax([raw[t] for t in distinct])))


def token_piece(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


# ------------------------------------------------------------------------------ routes
@bp.post("/v1/score")
async def score() -> Any:
    req, ctx = await engine_request(ScoreRequest, lambda: new_id("score"))
    engine = ctx.engine
    source = exactly_one(req, "prompt", "messages")
    if req.candidates is None or not req.candidates:
        raise InvalidRequestError("'candidates' must hold at least one candidate", param="candidates")
    if len(req.candidates) > MAX_CANDIDATES:
        raise InvalidRequestError(f"'candidates' may hold at most {MAX_CANDIDATES}, not {len(req.candidates)}",
                                  param="candidates")
    tokenizer = engine.tokenizer
    ids, truncated, token_ids = await off_loop(_score_inputs, req, source, tokenizer, engine)
    raw, usage = await raw_logprobs(ctx, ids, token_ids, req)
    probs = distribution(raw, token_ids)
    results = [{"index": i, "candidate": c, "token_id": t, "token": token_piece(tokenizer, t),
                "logprob": raw[t], "probability": probs[t]} for i, (c, t) in enumerate(zip(req.candidates, token_ids))]
    return jsonify({"id": ctx.response_id, "object": "score", "created": now(), "model": ctx.model,
                    "results": results, "truncated": truncated, "usage": usage_json(usage)})


def _score_inputs(req: ScoreRequest, source: str, tokenizer: Any, engine: Engine) -> tuple[list[int], bool, list[int]]:
    vocab = engine.vocab_size
    token_ids = [candidate_token(c, i, tokenizer, vocab) for i, c in enumerate(req.candidates)]
    if source == "messages":
        ids = chat_ids(req.messages, tokenizer)
    elif isinstance(req.prompt, list):
        for t in req.prompt:
            if not 0 <= t < vocab:
                raise InvalidRequestError(f"'prompt': token id {t} is outside the vocabulary [0, {vocab})",
                                          param="prompt")
        ids = list(req.prompt)
    else:
        check_chars(req.prompt, "prompt")
        ids = tokenizer.encode(req.prompt, add_special_tokens=True)
    if not ids:
        raise InvalidRequestError(f"'{source}' must not be empty", param=source)
    ids, truncated = fit_context(ids, engine.max_model_len, req.truncate, source)
    return ids, truncated, token_ids


@bp.post("/v1/decide")
async def decide() -> Any:
    req, ctx = await engine_request(DecideRequest, lambda: new_id("decide"))
    engine = ctx.engine
    messages = decide_messages(req)
    tokenizer = engine.tokenizer
    letters = LETTERS[:len(req.options)]
    encoded = [tokenizer.encode(L, add_special_tokens=False, parse_special=False) for L in letters]
    letter_ids = [e[0] if e else -1 for e in encoded]
    if -1 in letter_ids or len(set(letter_ids)) != len(letter_ids):
        raise InvalidRequestError("this model's tokenizer does not give the option letters distinct first tokens",
                                  code="not_supported", param="options")
    ids = await off_loop(chat_ids, messages, tokenizer)
    ids, truncated = fit_context(ids, engine.max_model_len, req.truncate, "messages" if req.messages else "question")
    raw, usage = await raw_logprobs(ctx, ids, letter_ids, req)
    probs = distribution(raw, letter_ids)
    dist = [{"letter": L, "index": i, "option": o, "token_id": t, "probability": probs[t], "logprob": raw[t]}
            for i, (L, o, t) in enumerate(zip(letters, req.options, letter_ids))]
    best = max(dist, key=lambda d: d["probability"])   # the first of equals
    pick = {k: best[k] for k in ("letter", "index", "option", "probability")}
    return jsonify({"id": ctx.response_id, "object": "decision", "created": now(), "model": ctx.model,
                    "pick": pick, "distribution": dist, "truncated": truncated, "usage": usage_json(usage)})
