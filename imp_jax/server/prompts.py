"""Prompt construction for every route, in one place: a body's turns through the model's chat template (tools,
reasoning and template kwargs, image marks expanded), a raw or fill-in-the-middle prompt, and the tokenizing of
each. The dialects' body models say what their turns are (`for_template`, `template_messages`, ...); the
functions here turn those into the token ids an engine request holds. Each runs off the event loop
(limits.off_loop) and holds the text to the prompt-character limit (limits.check_chars) before tokenizing.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from imp_jax.errors import InvalidRequestError
from imp_jax.runtime.api import Engine
from imp_jax.runtime.request import ImageInput
from imp_jax.server.context import server
from imp_jax.server.image_parts import request_images
from imp_jax.server.image_prompts import NO_IMAGES, PromptImages, count_marks, expand
from imp_jax.server.limits import check_chars
from imp_jax.server.reasoning import anthropic_thinking, template_kwargs
from imp_jax.server.tools import ToolPlan, render_prompt
from imp_jax.server.validation import check_token_ids

if TYPE_CHECKING:
    from imp_jax.server.anthropic_messages import Conversation
    from imp_jax.server.chat_completions import ChatMessage, ChatRequest
    from imp_jax.server.completions import CompletionRequest
    from imp_jax.server.infill import InfillRequest
    from imp_jax.server.responses import ResponsesRequest

Prompt = tuple[list[int], tuple[ImageInput, ...]]   # token ids, and the images in the order the prompt holds them

# apply_chat_template's own parameters: a template variable of these names would clash with them
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "continue_final_message", "tools",
                                      "documents", "template_name"})
SYSTEM_ROLES = ("system", "developer")
# Spellings of the token that starts a file in repository-level FIM training (StarCoder2, Qwen2.5-Coder).
FILE_SEPARATORS = ("<file_sep>", "<|file_sep|>")


async def prompt_images(body: Any, engine: Engine) -> PromptImages:
    """The body's image parts (`body.image_refs()`) decoded (a 400 naming the first bad one), then the vision gate."""
    refs = body.image_refs()
    return PromptImages(refs, await request_images(refs, engine, server().config.image_limits))


def templated(engine: Engine, messages: list[dict[str, Any]], plan: ToolPlan | None, images: PromptImages,
              param: str, **kwargs: Any) -> Prompt:
    """`messages` through the chat template (render_prompt: tools, `kwargs`), checked against the prompt limit
    as `param`, image marks expanded, tokenized (encode_chat: message text never becomes control tokens)."""
    text = render_prompt(engine.tokenizer, messages, plan, **kwargs)
    check_chars(text, param)
    text, in_order = expand(text, images, engine, param, count_marks(m["content"] for m in messages))
    return engine.tokenizer.encode_chat(text), in_order


# ------------------------------------------------------------------------------ OpenAI Chat
def chat_prompt(req: ChatRequest, engine: Engine, images: PromptImages = NO_IMAGES,
                messages: list[dict[str, Any]] | None = None) -> Prompt:
    """The conversation (or `messages`) with the model's chat template, tokenized."""
    cont = req.continue_final_message
    if messages is None:
        messages = [m.for_template(images, f"messages[{i}]") for i, m in enumerate(req.messages)]
    return templated(engine, messages, req.tool_plan, images, "messages",
                     add_generation_prompt=req.add_generation_prompt and not cont, continue_final_message=cont,
                     **template_kwargs(req.chat_template_kwargs, req.enable_thinking, req.reasoning_effort))


def cfg_shadow_prompt(req: ChatRequest, engine: Engine) -> list[int] | None:
    """cfg_scale's shadow prompt: the conversation without its system messages, with cfg_negative_prompt
    as the system message when given (None: guidance off)."""
    if not req.guided:
        return None
    messages = [m.for_template() for m in req.messages if m.role not in SYSTEM_ROLES]
    if not messages:
        raise InvalidRequestError("'cfg_scale' needs a message besides the system message", param="cfg_scale")
    if req.cfg_negative_prompt is not None:
        messages.insert(0, {"role": "system", "content": req.cfg_negative_prompt})
    return chat_prompt(req, engine, messages=messages)[0]


def refuse_images(messages: list[ChatMessage]) -> None:
    """400 naming the first image or video part: routes that render chats as text only (scoring, tokenize)."""
    for i, m in enumerate(messages):
        for j, p in enumerate(m.content or []):
            if p.type != "text":
                raise InvalidRequestError(f"'messages[{i}].content[{j}]': {p.type} parts are taken on "
                                          "/v1/chat/completions only", param=f"messages[{i}].content[{j}]",
                                          code="not_supported")


def text_chat_prompt(messages: list[ChatMessage], tokenizer: Any, add_generation_prompt: bool = True) -> list[int]:
    """Chat messages of text only (refuse_images) through the bare chat template, tokenized: /tokenize's and
    the scoring routes' prompt."""
    refuse_images(messages)
    text = tokenizer.render_chat([m.for_template() for m in messages], add_generation_prompt=add_generation_prompt)
    check_chars(text, "messages")
    return tokenizer.encode_chat(text)


# ------------------------------------------------------------------------------ OpenAI Completions, /infill
def completion_prompt(req: CompletionRequest, tokenizer: Any, vocab_size: int) -> list[int]:
    """The prompt as token ids; with `suffix`, a prefix-suffix-middle fill-in-the-middle prompt."""
    if isinstance(req.prompt, list):
        check_token_ids(req.prompt, vocab_size, "prompt")
        prefix = list(req.prompt)
    else:
        check_chars(req.prompt, "prompt")
        prefix = tokenizer.encode(req.prompt, add_special_tokens=req.suffix is None)
        if not prefix and req.suffix is None and tokenizer.bos_id is not None:
            prefix = [tokenizer.bos_id]
    if req.suffix is None:
        return prefix
    if not tokenizer.has_fim:
        raise InvalidRequestError("'suffix' needs fill-in-the-middle tokens and this model has none",
                                  code="fim_not_supported", param="suffix")
    fim = {k: tokenizer.token_to_id(v) for k, v in tokenizer.fim_tokens.items()}
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    check_chars(req.suffix, "suffix")
    suffix = tokenizer.encode(req.suffix, add_special_tokens=False)
    return bos + [fim["prefix"]] + prefix + [fim["suffix"]] + suffix + [fim["middle"]]


def infill_prompt(req: InfillRequest, tokenizer: Any) -> list[int]:
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


# ------------------------------------------------------------------------------ Anthropic Messages
def messages_prompt(conv: Conversation, engine: Engine, images: PromptImages = NO_IMAGES) -> Prompt:
    """Render the turns with the chat template; a final assistant turn with text is continued, not closed."""
    messages, prefill = conv.template_messages(images)
    return templated(engine, messages, conv.tool_plan, images, "messages", add_generation_prompt=not prefill,
                     continue_final_message=prefill, enable_thinking=anthropic_thinking(conv.thinking).enabled)


def breakpoint_tokens(conv: Conversation, engine: Engine, ids: list[int],
                      images: PromptImages = NO_IMAGES) -> int | None:
    """How many leading tokens of the prompt `ids` the last cache_control breakpoint covers: the prompt's common
    token prefix with the conversation rendered through that block (None: the whole prompt)."""
    cut = conv.through_breakpoint()
    if cut is None:
        return None
    messages, _ = cut.template_messages(images)
    if not messages:
        return None
    text = render_prompt(engine.tokenizer, messages, conv.tool_plan, add_generation_prompt=False,
                         enable_thinking=anthropic_thinking(conv.thinking).enabled)
    part = engine.tokenizer.encode_chat(expand(text, images, engine, "messages")[0])
    n = 0
    while n < min(len(part), len(ids)) and part[n] == ids[n]:
        n += 1
    return n


# ------------------------------------------------------------------------------ OpenAI Responses
def responses_prompt(req: ResponsesRequest, engine: Engine, conversation: list[dict[str, Any]],
                     images: PromptImages) -> Prompt:
    """The conversation after `instructions` through the chat template, tokenized; with `truncation: "auto"`
    less its oldest turns where the whole would leave no room to generate (fit_context)."""
    cont = req.continue_final_message
    kwargs = template_kwargs(req.chat_template_kwargs, req.enable_thinking, (req.reasoning or {}).get("effort"),
                             "reasoning.effort")
    in_order: tuple[ImageInput, ...] = ()

    def tokenize(turns: list[dict[str, Any]]) -> list[int]:
        nonlocal in_order
        ids, in_order = templated(engine, template_messages(req, turns), req.tool_plan, images, "input",
                                  add_generation_prompt=not cont, continue_final_message=cont, **kwargs)
        return ids

    if req.truncation == "auto":
        return fit_context(conversation, tokenize, engine.max_model_len), in_order
    return tokenize(conversation), in_order


def template_messages(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """instructions as the system message, then the conversation; developer is spelled system."""
    head = [{"role": "system", "content": req.instructions}] if req.instructions else []
    return head + [{**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in conversation]


def fit_context(conversation: list[dict[str, Any]], tokenize: Callable[[list[dict[str, Any]]], list[int]],
                max_model_len: int) -> list[int]:
    """`truncation: "auto"`: the prompt ids of the conversation less its oldest turns, as few as leave the
    context room to generate. System and developer messages and the last user turn are kept; a dropped
    turn takes the tool results after it along. Nothing left to drop: the whole prompt (check_context's 400)."""
    turns = list(conversation)
    ids = tokenize(turns)
    while len(ids) >= max_model_len:
        last_user = max((i for i, m in enumerate(turns) if m["role"] == "user"), default=len(turns))
        first = next((i for i, m in enumerate(turns[:last_user]) if m["role"] not in ("system", "developer")), None)
        if first is None:
            return ids
        end = first + 1
        while end < last_user and turns[end]["role"] == "tool":
            end += 1
        del turns[first:end]
        ids = tokenize(turns)
    return ids
