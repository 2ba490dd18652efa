"""llama.cpp's fill-in-the-middle route: `POST /infill` (`input_prefix`, `input_suffix`, `input_extra`,
`prompt`), answered in llama.cpp's `/completion` shape, on the FIM tokens `/v1/completions`'s
`suffix` uses. A model without FIM tokens is a 400 `fim_not_supported`."""
from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field
from quart import Blueprint

from imp_jax.errors import InvalidRequestError
from imp_jax.runtime.request import EngineEvent, GenerationRequest, SamplingParams, Usage, check_context
from imp_jax.server import fields, lifecycle, structured
from imp_jax.server.context import answering_model, default_max_tokens, engine_request, set_response_id
from imp_jax.server.errors import openai_error_body
from imp_jax.server.generation import collect
from imp_jax.server.limits import check_chars, json_reply, off_loop
from imp_jax.server.openai_common import OpenAISampling, new_id
from imp_jax.server.streaming import drive, sse, sse_response
from imp_jax.server.validation import WireModel

bp = Blueprint("infill", __name__)

# Spellings of the token that starts a file in repository-level FIM training (StarCoder2, Qwen2.5-Coder).
FILE_SEPARATORS = ("<file_sep>", "<|file_sep|>")


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


def infill_ids(req: InfillRequest, tokenizer: Any) -> list[int]:
    """[BOS] + extra files + <fim_prefix> prefix <fim_suffix> suffix <fim_middle> prompt (llama.cpp's layout).
    Each extra chunk is `<file_sep>filename\\ntext` where the vocabulary has a file separator, else its
    text and a newline."""
    if not tokenizer.has_fim:
        raise InvalidRequestError("/infill needs fill-in-the-middle tokens and this model has none",
                                  code="fim_not_supported", param="input_prefix")
    fim = {k: tokenizer.token_to_id(v) for k, v in tokenizer.fim_tokens.items()}
    sep = next((i for i in map(tokenizer.token_to_id, FILE_SEPARATORS) if i is not None), None)

    def enc(text: str) -> list[int]:
        check_chars(text, "input_prefix")
        return tokenizer.encode(text, add_special_tokens=False) if text else []

    ids = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    for chunk in req.input_extra:
        if sep is not None:
            ids += [sep] + enc(f"{chunk.filename}\n{chunk.text}")
        else:
            ids += enc(chunk.text + "\n")
    return (ids + [fim["prefix"]] + enc(req.input_prefix) + [fim["suffix"]] + enc(req.input_suffix)
            + [fim["middle"]] + enc(req.prompt))


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


@bp.post("/infill")
async def infill() -> Any:
    req, engine = await engine_request(InfillRequest)
    req.check()
    ids = await off_loop(infill_ids, req, engine.tokenizer)
    check_context(len(ids), req.max_tokens, engine.max_model_len, "input_prefix")
    max_tokens = default_max_tokens(req.max_tokens, len(ids), engine.max_model_len)
    params: SamplingParams = req.sampling_params(max_tokens, None, engine.vocab_size)
    constraint = await structured.constraint(req.output_format(), engine, params)
    rid = new_id("cmpl")
    set_response_id(rid)
    greq = GenerationRequest(rid, ids, params, priority=req.priority or 0, cache_prompt=bool(req.cache_prompt),
                             constraint=constraint)
    events = await lifecycle.begin(engine, greq, bool(req.stream))
    if req.stream:
        return sse_response(drive(engine, rid, events, InfillStream(rid, answering_model(engine))))
    result = await collect(engine, greq, events)
    (choice,) = result.choices
    return await json_reply(lambda: {"index": 0, "content": choice.text, "tokens": choice.token_ids,
                                     **final_fields(rid, answering_model(engine), result.usage, choice.finish_reason,
                                                    choice.stop_reason)})


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
