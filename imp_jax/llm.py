"""Offline generation without a server: `LLM(model).generate(prompts, SamplingParams(...))` (vLLM-like)."""
from __future__ import annotations

import dataclasses
import functools
import uuid
from typing import Any, Sequence, cast

from imp_jax.model.formats.hub import DEFAULT_MODEL
from imp_jax.runtime.core.builder import build_engine
from imp_jax.runtime.config import EngineConfig
from imp_jax.runtime.request import EngineEvent, GenerationRequest, SamplingParams, TokenLogprob, Usage


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    usage: Usage | None


class LLM:
    """Loads a model into an engine core and runs batches of prompts to completion.

    `engine_args` are EngineConfig's fields (the server's flags). `gemm="auto"` (the default), on an x86-64
    CPU: `cpu_q8` for a quantised GGUF (its blocks meet int8-rounded activations, llama.cpp's arithmetic:
    1.3-2x faster decode, outputs differ slightly), `exact` for float weights; `gemm="exact"` gives
    transformers' float32 products bit for bit on any model (`"cpu"` is its old name).
    """

    def __init__(self, model: str = DEFAULT_MODEL, **engine_args: Any):
        self.core = build_engine(EngineConfig(model=model, **engine_args))
        self.tokenizer = self.core.tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 chat: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids), all batched together; outputs in prompt order."""
        one = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
        batch = cast("list[str | Sequence[int]]", [prompts] if one else list(prompts))
        plist = params if isinstance(params, Sequence) else [params or SamplingParams()] * len(batch)
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        for prompt, p in zip(batch, plist):
            ids = self._encode(prompt, chat)
            rid = uuid.uuid4().hex
            out = RequestOutput(rid, ids, [CompletionOutput(i, "", [], None) for i in range(p.n)], None)
            results[rid], order = out, order + [rid]
            self.core.add_request(GenerationRequest(rid, ids, dataclasses.replace(p)), functools.partial(_collect, out))
        while self.core.has_work():
            self.core.step()
        return [results[r] for r in order]

    def _encode(self, prompt: str | Sequence[int], chat: bool) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if chat:
            text = self.tokenizer.render_chat([{"role": "user", "content": prompt}])
            return self.tokenizer.encode_chat(text)
        return self.tokenizer.encode(prompt)


def _collect(out: RequestOutput, ev: EngineEvent) -> None:
    c = out.outputs[ev.index]
    c.text += ev.text
    c.token_ids += ev.token_ids
    if ev.logprobs:
        c.logprobs = (c.logprobs or []) + ev.logprobs
    if ev.finish_reason:
        c.finish_reason = ev.finish_reason
    if ev.usage:
        out.usage = ev.usage
