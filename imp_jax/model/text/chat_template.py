"""Chat templates: render a model's Jinja template with Hugging Face transformers' semantics, sandboxed.

Templates come from model files, so they are untrusted code: they run in jinja2's
ImmutableSandboxedEnvironment, and every failure inside one is a TemplateError (a 400).
"""
from __future__ import annotations

import contextvars
import dataclasses
import functools
import json
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import jinja2.sandbox
from jinja2.sandbox import ImmutableSandboxedEnvironment

from imp_jax.errors import TemplateError

# Appended to the final message for continue_final_message; the render is cut where it lands (as HF does).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# Older names for a message's reasoning; HF copies them to `reasoning_content` (and `thinking`) for templates.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Bounds on one render (the template is code from the model files; a loop in it must not hold a worker):
RENDER_TIMEOUT_S = 10.0          # wall time, checked at every output chunk, call, attribute and range step
MAX_RENDERED_CHARS = 64 << 20    # characters of output
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("chat_template_deadline", default=None)


def render_chat_template(
    source: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    continue_final_message: bool = False,
    variables: Mapping[str, Any] | None = None,
    max_chars: int = MAX_RENDERED_CHARS,
) -> str:
    """Render `messages` with the template `source`, as transformers' apply_chat_template(tokenize=False).

    `variables` are extra template variables (bos_token, eos_token, enable_thinking, ...).
    With continue_final_message the output ends right after the final assistant message's text.
    A render past RENDER_TIMEOUT_S or `max_chars` characters of output is a TemplateError.
    """
    if not source:
        raise TemplateError("model has no chat template")
    if continue_final_message and add_generation_prompt:
        raise TemplateError("continue_final_message and add_generation_prompt cannot both be set")
    chat = _normalize_messages(messages)
    if not chat:
        raise TemplateError("cannot apply a chat template to an empty list of messages")
    final_text = _tag_final_message(chat, source) if continue_final_message else None
    context = {
        **_plain(dict(variables or {})),
        "messages": chat,
        "tools": _plain_dicts(tools, "tools"),
        "documents": _plain_dicts(documents, "documents"),
        "add_generation_prompt": add_generation_prompt,
    }
    template = compile_template(source)
    token = _DEADLINE.set(time.monotonic() + RENDER_TIMEOUT_S)
    try:
        rendered = _bounded_render(template, context, max_chars)
    except TemplateError:
        raise
    except _RaisedByTemplate as e:
        raise TemplateError(e.message or "the chat template rejected the conversation") from e
    except Exception as e:  # the template is untrusted code: any failure in it is the request's problem
        raise TemplateError(f"chat template error: {_describe(e)}") from e
    finally:
        _DEADLINE.reset(token)
    if final_text is not None:
        rendered = _cut_after_final_message(rendered, final_text)
    return rendered


def _bounded_render(template: jinja2.Template, context: dict[str, Any], max_chars: int) -> str:
    """template.render, chunk by chunk, stopped past the output bound or the deadline."""
    parts, size = [], 0
    for chunk in template.generate(**context):
        size += len(chunk)
        if size > max_chars:
            raise TemplateError(f"the chat template's output exceeds {max_chars} characters")
        _check_deadline()
        parts.append(chunk)
    return "".join(parts)


def _check_deadline() -> None:
    deadline = _DEADLINE.get()
    if deadline is not None and time.monotonic() > deadline:
        raise TemplateError(f"the chat template ran longer than {RENDER_TIMEOUT_S:g} s")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox with the render deadline checked at every call, attribute and item access."""

    def call(self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
        _check_deadline()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _check_deadline()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _check_deadline()
        return super().getitem(obj, argument)


class _BoundedRange:
    """`range` in templates: the sandbox's size cap, and the render deadline checked as it is walked."""

    def __init__(self, *args: int):
        self.values = jinja2.sandbox.safe_range(*args)

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, index: Any) -> Any:
        return self.values[index]

    def __contains__(self, value: Any) -> bool:
        return value in self.values

    def __iter__(self) -> Any:
        return _checked(iter(self.values))

    def __reversed__(self) -> Any:
        return _checked(reversed(self.values))


def _checked(values: Any) -> Any:
    for i, value in enumerate(values):
        if i % 1024 == 0:
            _check_deadline()
        yield value


@functools.lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    """Compile a template once per source string (the cache is what keeps rendering cheap per request)."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateError as e:
        raise TemplateError(f"chat template error: {_describe(e)}") from e


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    """The one sandboxed environment, configured like transformers' (trim/lstrip blocks, HF globals)."""
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    env.globals["range"] = _BoundedRange
    return env


class _RaisedByTemplate(jinja2.exceptions.TemplateError):
    """What `raise_exception(msg)` raises; its message goes to the client unchanged."""


def _raise_exception(message: str) -> None:
    """`raise_exception(msg)` in a template: how templates reject a conversation they cannot format."""
    raise _RaisedByTemplate(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """HF's tojson: plain json.dumps (no HTML escaping), non-ASCII kept, indent supported."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    """`strftime_now(fmt)`: the current local time, e.g. for a system prompt's date."""
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` in templates without exposing the dict type itself (as HF)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names, so templates cannot reach interpreter internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 — jinja's Namespace signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} may not start with an underscore")


class _GenerationBlock(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` (HF's assistant-mask markers) and render the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Plain-data copies of the messages with None-valued keys dropped and reasoning aliased (as HF)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TemplateError("messages must be a list of message objects")
    chat = []
    for message in messages:
        message = _plain(message)
        if not isinstance(message, dict):
            raise TemplateError(f"a chat message must be an object, got {type(message).__name__}")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    return chat


def _tag_final_message(chat: list[dict[str, Any]], source: str) -> str:
    """Append the cut marker to the final assistant message's (last) text; return that text untagged."""
    final = chat[-1]
    if final.get("role") != "assistant":
        raise TemplateError("continue_final_message needs the final message to be from the assistant")
    if "content" not in source:
        raise TemplateError("continue_final_message is set but the chat template never reads message content")
    content = final.get("content")
    if isinstance(content, str):
        final["content"] = content + _CONTINUE_TAG
        return content
    if isinstance(content, (list, tuple)):
        for block in reversed(content):
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                text = block["text"]
                block["text"] = text + _CONTINUE_TAG
                return text
    raise TemplateError("continue_final_message is set but the final message has no text to continue")


def _cut_after_final_message(rendered: str, final_text: str) -> str:
    """Cut the render right after the final message's text (HF: at the last marker; rstrip if it was trimmed)."""
    marker = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or marker not in rendered:
        raise TemplateError(
            "continue_final_message is set but the chat template does not render the final message's text"
        )
    at = rendered.rindex(marker)
    if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()


def _plain_dicts(items: Sequence[Mapping[str, Any]] | None, name: str) -> list[dict[str, Any]] | None:
    """Tools/documents as plain data; each entry must be an object (a JSON schema or a document)."""
    if items is None:
        return None
    plain = _plain(list(items))
    if not all(isinstance(item, dict) for item in plain):
        raise TemplateError(f"every entry of {name} must be an object")
    return plain


def _plain(value: Any) -> Any:
    """Rebuild `value` from plain JSON types, so the sandbox only ever sees str/int/float/bool/None/dict/list."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return _plain(value.model_dump())
    if type(value).__module__ == "numpy" and callable(getattr(value, "item", None)):  # numpy scalars
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _describe(error: Exception) -> str:
    """A short message for a template failure, with the template line when jinja knows it."""
    message = getattr(error, "message", None) or str(error) or type(error).__name__
    lineno = getattr(error, "lineno", None)
    return f"{message} (line {lineno})" if lineno else message
