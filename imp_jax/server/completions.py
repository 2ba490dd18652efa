"""OpenAI legacy Completions: `POST /v1/completions` (one prompt, echo, legacy logprobs, FIM via suffix)."""
from __future__ import annotations

from typing import Any, ClassVar

from pydantic import field_validator
from quart import Blueprint

from imp_jax.errors import InvalidRequestError
from imp_jax.runtime.request import EngineEvent
from imp_jax.server import fields, structured
from imp_jax.server.dialect import Dialect, Plan, serve
from imp_jax.server.generation import Completion
from imp_jax.server.limits import off_loop
from imp_jax.server.logprobs import LegacyLogprobs, TokenText, merge_legacy, prompt_logprobs_json
from imp_jax.server.openai_common import OpenAISampling, OpenAIStream, new_id, now, usage_json
from imp_jax.server.prompts import completion_prompt

bp = Blueprint("completions", __name__)


class CompletionRequest(OpenAISampling, structured.OutputFormatFields):
    EXTRAS: ClassVar[frozenset[str]] = fields.SAMPLING_EXTRAS
    HINTS: ClassVar[dict[str, str]] = {
        "top_logprobs": "send 'logprobs': N", "max_completion_tokens": "use 'max_tokens'",
        "messages": "conversations go to /v1/chat/completions", "cache_control": "use 'cache_prompt'"}

    prompt: str | list[int]
    suffix: str | None = None
    echo: bool | None = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        """A string, a token-id list, or a one-element list of either; a batch is refused."""
        if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
            if len(v) > 1:
                raise ValueError("a batch of prompts is not supported; send one prompt per request")
            v = v[0]
        if isinstance(v, str):
            return v
        if isinstance(v, list):
            if not v:
                raise ValueError("must not be empty")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
                raise ValueError("must be a string, a list of token ids, or a one-element list of either")
            return v
        raise ValueError("must be a string, a list of token ids, or a one-element list of either")

    def check(self) -> None:
        self.check_common()
        if self.stream and self.prompt_logprobs is not None:
            raise InvalidRequestError("'prompt_logprobs' cannot be used with 'stream': true", param="prompt_logprobs")
        if self.stream and self.echo and self.logprobs is not None:
            raise InvalidRequestError("'echo' with 'logprobs' cannot be used with 'stream': true", param="echo")

    def prompt_logprobs_needed(self) -> int | None:
        """How many top alternatives the engine must score per prompt token (None: no prompt scoring)."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None


class CompletionDialect(Dialect):
    """OpenAI legacy Completions: one prompt (text, token ids, or FIM with `suffix`), echo and legacy logprobs."""

    body = CompletionRequest
    req: CompletionRequest
    echo = ""   # the prompt text the reply starts with (`echo`)

    @staticmethod
    def mint_id() -> str:
        return new_id("cmpl")

    async def plan(self) -> Plan:
        req, engine = self.req, self.engine
        ids = await off_loop(completion_prompt, req, engine.tokenizer, engine.vocab_size)
        params = req.sampling_params(self.max_tokens(ids, req.max_tokens, "prompt"), req.logprobs, engine.vocab_size)
        params.prompt_logprobs = req.prompt_logprobs_needed()
        constraint = await structured.constraint(req.output_format(), engine, params)
        if req.echo:
            self.echo = (req.prompt if isinstance(req.prompt, str)
                         else engine.tokenizer.decode(req.prompt, skip_special_tokens=False))
        return Plan(ids, params, bool(req.stream), {**self.scheduling(), "constraint": constraint})

    def stream(self, plan: Plan) -> CompletionStream:
        return CompletionStream(self.ctx.response_id, self.ctx.model, self.req.include_usage,
                                TokenText(self.engine.tokenizer), self.echo, self.req.logprobs is not None)

    def reply(self, plan: Plan, result: Completion) -> dict[str, Any]:
        return completion_response(self.ctx.response_id, self.ctx.model, result, TokenText(self.engine.tokenizer),
                                   self.echo, self.req, plan.ids)


@bp.post("/v1/completions")
async def completions() -> Any:
    return await serve(CompletionDialect)


def completion_response(rid: str, model: str, result: Completion, token_text: TokenText, echo: str,
                        req: CompletionRequest, ids: list[int]) -> dict[str, Any]:
    """The non-streamed `text_completion` object; echo + logprobs puts the scored prompt tokens first."""
    choices = []
    scored_echo = bool(req.echo) and req.logprobs is not None and result.prompt_logprobs is not None
    prompt_lp = (prompt_logprobs_json(result.prompt_logprobs, req.prompt_logprobs, token_text)   # one prompt: built once
                 if req.prompt_logprobs is not None and result.prompt_logprobs is not None else None)
    for c in result.choices:
        lp = None
        if req.logprobs is not None:
            legacy = LegacyLogprobs(token_text, 0 if scored_echo else len(echo))
            parts = [legacy.scored_prompt(ids, result.prompt_logprobs, req.logprobs)] if scored_echo else []
            lp = merge_legacy(parts + [legacy.chunk(c.logprobs)])
        choice = {"index": c.index, "text": echo + c.text, "logprobs": lp,
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if prompt_lp is not None:
            choice["prompt_logprobs"] = prompt_lp
        choices.append(choice)
    return {"id": rid, "object": "text_completion", "created": now(), "model": model,
            "system_fingerprint": None, "choices": choices, "usage": usage_json(result.usage)}


class CompletionStream(OpenAIStream):
    """`text_completion` chunks: the echoed prompt first (if asked), text deltas, usage, [DONE]."""

    object_name = "text_completion"

    def __init__(self, rid: str, model: str, include_usage: bool, token_text: TokenText, echo: str,
                 logprobs: bool):
        super().__init__(rid, model, include_usage)
        self._token_text, self._echo, self._logprobs = token_text, echo, logprobs
        self._legacy: dict[int, LegacyLogprobs] = {}

    def event(self, ev: EngineEvent) -> list[str]:
        text = ev.text
        if ev.index not in self._legacy:
            self._legacy[ev.index] = LegacyLogprobs(self._token_text, len(self._echo))
            text = self._echo + text
        if not (text or ev.logprobs or ev.finish_reason is not None):
            return []
        lp = self._legacy[ev.index].chunk(ev.logprobs or []) if self._logprobs else None
        choice = {"index": ev.index, "text": text, "logprobs": lp, "finish_reason": ev.finish_reason}
        if ev.finish_reason is not None:
            choice["stop_reason"] = ev.stop_reason
        return [self._chunk([choice])]

