"""`POST /tokenize` (llama.cpp `content` or vLLM `prompt` / `messages`) and `POST /detokenize`."""
from __future__ import annotations

from typing import Any

from quart import Blueprint

from imp_jax.errors import InvalidRequestError
from imp_jax.server.chat_completions import ChatMessage
from imp_jax.server.context import engine_request
from imp_jax.server.limits import check_chars, json_reply, off_loop
from imp_jax.server.prompts import text_chat_prompt
from imp_jax.server.validation import WireModel, check_token_ids

bp = Blueprint("tokens", __name__)
MAX_PIECES = 1 << 16   # tokens /tokenize spells out with `with_pieces` (each a decode and a JSON object)


class TokenizeRequest(WireModel):
    model: str | None = None
    content: str | None = None           # llama.cpp
    prompt: str | None = None            # vLLM
    messages: list[ChatMessage] | None = None  # vLLM's chat form: the rendered template is tokenized
    add_special: bool | None = None      # llama.cpp, default false
    add_special_tokens: bool | None = None  # vLLM, default true
    add_generation_prompt: bool = True
    with_pieces: bool = False            # llama.cpp: [{id, piece}] instead of ids
    parse_special: bool = True           # llama.cpp: special-token spellings in content/prompt are tokens


class DetokenizeRequest(WireModel):
    model: str | None = None
    tokens: list[int]


@bp.post("/tokenize")
async def tokenize() -> Any:
    req, ctx = await engine_request(TokenizeRequest)
    engine = ctx.engine
    tokenizer = engine.tokenizer
    given = [name for name in ("content", "prompt", "messages") if getattr(req, name) is not None]
    if len(given) != 1:
        raise InvalidRequestError("send exactly one of 'content', 'prompt' or 'messages'",
                                  param=given[1] if len(given) > 1 else "content")
    ids = await off_loop(_tokenize, req, tokenizer)
    if req.with_pieces and len(ids) > MAX_PIECES:
        raise InvalidRequestError(f"'with_pieces' lists at most {MAX_PIECES} tokens; this input has {len(ids)} "
                                  "(ask for the ids alone)", param="with_pieces", code="response_too_large")

    def reply() -> dict[str, Any]:
        tokens = [{"id": t, "piece": tokenizer.decode([t], skip_special_tokens=False)} for t in ids] \
            if req.with_pieces else ids
        return {"tokens": tokens, "count": len(ids), "max_model_len": engine.max_model_len}

    return await json_reply(reply)


def _tokenize(req: TokenizeRequest, tokenizer: Any) -> list[int]:
    if req.messages is not None:
        return text_chat_prompt(req.messages, tokenizer, req.add_generation_prompt)
    text = req.content if req.content is not None else req.prompt
    check_chars(text, "content" if req.content is not None else "prompt")
    add = req.add_special if req.add_special is not None else req.add_special_tokens
    if add is None:
        add = req.content is None  # llama.cpp's default is false, vLLM's true
    return tokenizer.encode(text, add_special_tokens=add, parse_special=req.parse_special)


@bp.post("/detokenize")
async def detokenize() -> Any:
    req, ctx = await engine_request(DetokenizeRequest)
    check_token_ids(req.tokens, ctx.engine.vocab_size, "tokens")
    text = await off_loop(ctx.engine.tokenizer.decode, req.tokens, skip_special_tokens=False)
    return await json_reply(lambda: {"content": text, "prompt": text})
