"""llama.cpp's fill-in-the-middle route: `POST /infill` (`input_prefix`, `input_suffix`, `input_extra`,
`prompt`), answered in llama.cpp's `/completion` shape, on the FIM tokens `/v1/completions`'s
`suffix` uses. A model without FIM tokens is a 400 `fim_not_supported`."""
from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field
from quart import Blueprint

from imp_jax.errors import InvalidRequestError
from imp_jax.runtime.request import EngineEvent, Usage
from imp_jax.server import fields, structured
from imp_jax.server.dialect import Dialect, Plan, serve
from imp_jax.server.errors import openai_error_body
from imp_jax.server.generation import Completion
from imp_jax.server.limits import off_loop
from imp_jax.server.openai_common import OpenAISampling, new_id
from imp_jax.server.prompts import infill_prompt
from imp_jax.server.streaming import sse
from imp_jax.server.validation import WireModel

bp = Blueprint("infill", __name__)


class ExtraChunk(WireModel):
    """One `input_extra` entry: context from another file."""

    filename: str = ""
    text: str


class InfillRequest(OpenAISampling, structured.OutputFormatFields):
    """llama.cpp's fields beside the OpenAI sampling ones (`n_predict` = max_tokens, `repeat_penalty` =
    repetition_penalty) and the output-format ones (llama.cpp's `grammar`, `json_schema`, ...); `model` may
    be left out."""

    EXTRAS: ClassVar[frozenset[str]] = fields.SAMPLING_EXTRAS
    REFUSED: ClassVar[dict[str, str]] = {"stream_options": "an /infill stream always ends with its counts"}
    HINTS: ClassVar[dict[str, str]] = {
        **{f: "logprobs are served on /v1/completions (its 'suffix' is fill-in-the-middle too)"
           for f in fields.LOGPROBS}, "suffix": "use 'input_suffix'", "messages": "use 'input_prefix'"}

    model: str | None = None  # type: ignore[assignment]
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraChunk] = Field(default_factory=list, max_length=1024)
    prompt: str = ""
    n_predict: int | None = None
    repeat_penalty: float | None = None

    def check(self) -> None:
        self.check_common()
        if (self.n or 1) != 1:
            raise InvalidRequestError("/infill makes one completion; 'n' must be 1", param="n")
        if self.n_predict is not None:
            if self.max_tokens is not None:
                raise InvalidRequestError("send 'n_predict' or 'max_tokens', not both", param="n_predict")
            if self.n_predict == 0 or self.n_predict < -1:
                raise InvalidRequestError("'n_predict' must be -1 (no limit but the context) or >= 1",
                                          param="n_predict")
            self.max_tokens = None if self.n_predict == -1 else self.n_predict
        if self.repeat_penalty is not None:
            if self.repetition_penalty is not None:
                raise InvalidRequestError("send 'repeat_penalty' or 'repetition_penalty', not both",
                                          param="repeat_penalty")
            self.repetition_penalty = self.repeat_penalty


def stop_type(finish_reason: str | None, stop_reason: Any) -> tuple[str, str]:
    """llama.cpp's (stop_type, stopping_word): `eos`, `word` with the stop string, `limit`."""
    if finish_reason == "length":
        return "limit", ""
    if isinstance(stop_reason, str):
        return "word", stop_reason
    return "eos", ""


def final_fields(rid: str, model: str, usage: Usage, finish_reason: str | None, stop_reason: Any) -> dict[str, Any]:
    kind, word = stop_type(finish_reason, stop_reason)
    return {"id": rid, "model": model, "stop": True, "stop_type": kind, "stopping_word": word,
            "tokens_predicted": usage.completion_tokens, "tokens_evaluated": usage.prompt_tokens,
            "tokens_cached": usage.cached_tokens, "truncated": False}


class InfillDialect(Dialect):
    """llama.cpp's /infill: the FIM prompt (prompts.infill_prompt), one completion in the `/completion` shape."""

    body = InfillRequest
    req: InfillRequest

    @staticmethod
    def mint_id() -> str:
        return new_id("cmpl")

    async def plan(self) -> Plan:
        req, engine = self.req, self.engine
        ids = await off_loop(infill_prompt, req, engine.tokenizer)
        params = req.sampling_params(self.max_tokens(ids, req.max_tokens, "input_prefix"), None, engine.vocab_size)
        constraint = await structured.constraint(req.output_format(), engine, params)
        return Plan(ids, params, bool(req.stream), {**self.scheduling(), "constraint": constraint})

    def stream(self, plan: Plan) -> InfillStream:
        return InfillStream(self.ctx.response_id, self.ctx.model)

    def reply(self, plan: Plan, result: Completion) -> dict[str, Any]:
        (choice,) = result.choices
        return {"index": 0, "content": choice.text, "tokens": choice.token_ids,
                **final_fields(self.ctx.response_id, self.ctx.model, result.usage, choice.finish_reason,
                               choice.stop_reason)}


@bp.post("/infill")
async def infill() -> Any:
    return await serve(InfillDialect)


class InfillStream:
    """llama.cpp's `/completion` stream: `data: {"content": ..., "stop": false}` chunks, then one with
    `"stop": true` and the counts; no `[DONE]`."""

    def __init__(self, rid: str, model: str):
        self._rid, self._model = rid, model
        self._finish: tuple[str | None, Any] = (None, None)

    def open(self) -> list[str]:
        return []

    def event(self, ev: EngineEvent) -> list[str]:
        if ev.finish_reason is not None:
            self._finish = (ev.finish_reason, ev.stop_reason)
        if not ev.text:
            return []
        return [sse({"index": 0, "content": ev.text, "tokens": list(ev.token_ids), "stop": False})]

    def close(self, usage: Usage | None) -> list[str]:
        return [sse({"index": 0, "content": "", "tokens": [],
                     **final_fields(self._rid, self._model, usage or Usage(0, 0, 0), *self._finish)})]

    def error(self, err: Any) -> list[str]:
        return [sse(openai_error_body(err))]

    def ping(self) -> list[str]:
        return []
