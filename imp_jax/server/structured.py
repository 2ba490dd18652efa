"""Structured output: every dialect's output-format fields as one llguidance grammar, checked at parse time.

The forms (docs/API.md, "Structured output"):
- Chat Completions and Completions: `response_format` (`json_object`, `json_schema`, `regex`, `grammar`),
  vLLM's `guided_json` / `guided_regex` / `guided_grammar` / `guided_choice` and `structured_outputs`,
  llama.cpp's `grammar` (GBNF) and `json_schema`; at most one of them per request.
- Responses: `text.format` (`json_schema`, `json_object`).
- Anthropic Messages: `output_config.format` or the beta's top-level `output_format` (`json_schema`).
- /infill: every Completions form above (llama.cpp's `grammar` and `json_schema` among them).
- A forced tool call (tools.py: `ToolPlan.output_format`) is one more form, compiled the same way; it
  cannot be combined with the ones above (`ToolPlan.admit`).

Each becomes an llguidance grammar string through llguidance's own converters (JSON schema, regex,
Lark, GBNF, choices), which the engine enforces token by token (runtime/decoding/constraints.py). Before any
stream starts the grammar is compiled against the model's tokenizer, so a constraint that cannot
compile, a schema keyword llguidance cannot enforce, or a form past the limits below is a 400 naming
the exact field; the compiled grammar is kept for the engine.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

from imp_jax.errors import InvalidRequestError
from imp_jax.runtime.api import Engine
from imp_jax.runtime.decoding.constraints import GrammarConstraints
from imp_jax.runtime.request import SamplingParams
from imp_jax.server.limits import field_limits
from imp_jax.server.validation import WireModel

MAX_SCHEMA_DEPTH = 32             # arrays and objects nested in a JSON schema document
MAX_CHOICES = 1024                # guided_choice entries
MAX_ERROR_CHARS = 600             # llguidance's message, as the 400 quotes it
# Compact, single-line JSON, as models write it; a schema's own "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclasses.dataclass(frozen=True)
class OutputFormat:
    """A request's output constraint: the llguidance grammar, the exact field it came from (its errors name it)
    and the request field that set it ('response_format', 'text.format', 'tool_choice', ...)."""

    grammar: str
    param: str
    field: str = ""


def json_schema(schema: Any, param: str) -> OutputFormat:
    """A JSON schema (an object), within the size and depth limits."""
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"'{param}' must be a JSON schema object", param=param)
    _check_size(json.dumps(schema, separators=(",", ":")), param)
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidRequestError(f"'{param}' nests {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are allowed",
                                  param=param)
    import llguidance

    try:
        return OutputFormat(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS), param)
    except ValueError as e:
        raise InvalidRequestError(f"'{param}' is not a usable JSON schema: {short_error(e)}", param=param) from None


def json_object(param: str) -> OutputFormat:
    """Any JSON object."""
    return json_schema({"type": "object"}, param)


def regex(pattern: Any, param: str) -> OutputFormat:
    """A regular expression the whole output matches (Rust regex syntax, no look-around)."""
    if not isinstance(pattern, str) or not pattern:
        raise InvalidRequestError(f"'{param}' must be a non-empty regular expression string", param=param)
    _check_size(pattern, param)
    import llguidance

    return OutputFormat(llguidance.LLMatcher.grammar_from_regex(pattern), param)


def grammar(text: Any, param: str, syntax: str | None = None) -> OutputFormat:
    """A context-free grammar in Lark (llguidance's dialect) or llama.cpp GBNF; detected unless `syntax` says."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidRequestError(f"'{param}' must be a non-empty grammar string", param=param)
    _check_size(text, param)
    import llguidance

    try:
        return OutputFormat(llguidance.grammar_from(syntax or "grammar", text), param)
    except ValueError as e:
        raise InvalidRequestError(f"'{param}' is not a valid Lark or GBNF grammar: {short_error(e)}",
                                  param=param) from None


def choice(choices: Any, param: str) -> OutputFormat:
    """Exactly one of the given strings."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequestError(f"'{param}' must be a non-empty list of non-empty strings", param=param)
    if len(choices) > MAX_CHOICES:
        raise InvalidRequestError(f"'{param}' may hold at most {MAX_CHOICES} choices", param=param)
    _check_size("".join(choices), param)
    import llguidance

    return OutputFormat(llguidance.grammar_from("choice", choices), param)


def _check_size(text: str, param: str) -> None:
    size, limit = len(text.encode("utf-8")), field_limits().constraint_bytes
    if size > limit:
        raise InvalidRequestError(f"'{param}' is {size} bytes; at most {limit} are allowed (--max-constraint-bytes)",
                                  param=param, code="constraint_too_large")


def _depth(value: Any) -> int:
    """How deep arrays and objects nest in `value` (iterative: the request parser already capped it)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is not None:
            deepest = max(deepest, d)
            stack.extend((c, d + 1) for c in children)
    return deepest


def short_error(err: Any) -> str:
    text = str(err).strip()
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + " ..."


# --------------------------------------------------------------------------- the dialects' fields
def _response_format(rf: dict[str, Any]) -> OutputFormat | None:
    """OpenAI's `response_format`, plus `regex` and `grammar` types (None: plain text)."""
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object("response_format")
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequestError("'response_format.json_schema' must be an object with 'name' and 'schema'",
                                      param="response_format.json_schema")
        if "schema" not in spec:
            raise InvalidRequestError("'response_format.json_schema.schema' is required",
                                      param="response_format.json_schema.schema")
        return json_schema(spec["schema"], "response_format.json_schema.schema")
    if kind == "regex":
        return regex(rf.get("regex"), "response_format.regex")
    if kind == "grammar":
        syntax = rf.get("syntax")
        if syntax not in (None, "lark", "gbnf"):
            raise InvalidRequestError("'response_format.syntax' must be 'lark' or 'gbnf' (or omitted: detected)",
                                      param="response_format.syntax")
        return grammar(rf.get("grammar"), "response_format.grammar", syntax)
    raise InvalidRequestError(f"'response_format.type' {kind!r} is not one of text, json_object, json_schema, "
                              "regex, grammar", param="response_format.type")


def _structured_outputs(so: dict[str, Any]) -> OutputFormat | None:
    """vLLM's `structured_outputs` object: one of json, regex, choice, grammar, json_object."""
    given = [k for k in ("json", "regex", "choice", "grammar", "json_object") if so.get(k) not in (None, False)]
    if len(given) > 1:
        raise InvalidRequestError(f"'structured_outputs' may set only one of json, regex, choice, grammar, "
                                  f"json_object; it sets {', '.join(given)}", param=f"structured_outputs.{given[1]}")
    if not given:
        return None
    key = given[0]
    param, value = f"structured_outputs.{key}", so[key]
    if key == "json":
        return json_schema(_maybe_json(value, param), param)
    if key == "json_object":
        return json_object(param)
    return {"regex": regex, "choice": choice, "grammar": grammar}[key](value, param)


def _maybe_json(value: Any, param: str) -> Any:
    """vLLM takes a schema as an object or as its JSON text."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise InvalidRequestError(f"'{param}' is a string but not JSON", param=param) from None
    return value


class OutputFormatFields(WireModel):
    """The output-format fields Chat Completions and Completions accept (OpenAI's, vLLM's, llama.cpp's)."""

    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None

    def output_format(self) -> OutputFormat | None:
        """The one constraint the request sets (None: free text); two at once is a 400."""
        forms: list[tuple[str, Any]] = [
            ("response_format", lambda: _response_format(self.response_format)),
            ("guided_json", lambda: json_schema(_maybe_json(self.guided_json, "guided_json"), "guided_json")),
            ("guided_regex", lambda: regex(self.guided_regex, "guided_regex")),
            ("guided_grammar", lambda: grammar(self.guided_grammar, "guided_grammar")),
            ("guided_choice", lambda: choice(self.guided_choice, "guided_choice")),
            ("structured_outputs", lambda: _structured_outputs(self.structured_outputs)),
            ("grammar", lambda: grammar(self.grammar, "grammar")),
            ("json_schema", lambda: json_schema(self.json_schema, "json_schema")),
        ]
        found = [(name, build()) for name, build in forms if getattr(self, name) is not None]
        found = [(name, form) for name, form in found if form is not None]
        if len(found) > 1:
            names = ", ".join(f"'{name}'" for name, _ in found)
            raise InvalidRequestError(f"set at most one output constraint; this request sets {names}",
                                      param=found[1][0])
        return _set_by(*found[0]) if found else None


def _set_by(field: str, form: OutputFormat | None) -> OutputFormat | None:
    return None if form is None else dataclasses.replace(form, field=field)


def responses_format(fmt: dict[str, Any] | None) -> OutputFormat | None:
    """Responses' `text.format`: text, json_schema (name, schema, strict) or json_object."""
    return _set_by("text.format", _text_format(fmt))


def _text_format(fmt: dict[str, Any] | None) -> OutputFormat | None:
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object("text.format")
    if kind == "json_schema":
        if "schema" not in fmt:
            raise InvalidRequestError("'text.format.schema' is required", param="text.format.schema")
        return json_schema(fmt["schema"], "text.format.schema")
    raise InvalidRequestError(f"'text.format.type' {kind!r} is not one of text, json_schema, json_object",
                              param="text.format.type")


def messages_format(output_config: dict[str, Any] | None, output_format: Any = None) -> OutputFormat | None:
    """Anthropic's `output_config.format` (JSON outputs), or the structured-outputs beta's top-level
    `output_format`: {"type": "json_schema", "schema": {...}}; at most one of the two."""
    config_format = (output_config or {}).get("format")
    if config_format is not None and output_format is not None:
        raise InvalidRequestError("set 'output_config.format' or 'output_format', not both", param="output_format")
    if output_format is not None:
        return _set_by("output_format", _output_config_format(output_format, "output_format"))
    return _set_by("output_config.format", _output_config_format(config_format, "output_config.format"))


def _output_config_format(fmt: Any, param: str) -> OutputFormat | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise InvalidRequestError(f"'{param}.type' must be 'json_schema'", param=f"{param}.type")
    if "schema" not in fmt:
        raise InvalidRequestError(f"'{param}.schema' is required", param=f"{param}.schema")
    return json_schema(fmt["schema"], f"{param}.schema")


# --------------------------------------------------------------------------- compile before the stream
async def constraint(form: OutputFormat | None, engine: Engine, params: SamplingParams) -> str | None:
    """The grammar for GenerationRequest.constraint, compiled against the model's tokenizer (on a worker
    thread) so that anything llguidance refuses is a 400 naming the field before any stream starts."""
    if form is None:
        return None
    # Both would leave the sampler no token once the grammar is complete (only EOS is allowed then).
    for knob in ("ignore_eos", "min_tokens"):
        if getattr(params, knob):
            raise InvalidRequestError(f"'{knob}' cannot be combined with '{form.field}': the constrained output "
                                      "ends where its grammar does", param=knob)
    constraints = GrammarConstraints.for_tokenizer(engine.tokenizer, engine.vocab_size)
    error = await asyncio.to_thread(constraints.compile, form.grammar)
    if error is not None:
        raise InvalidRequestError(f"'{form.param}' cannot be enforced: {short_error(error)}", param=form.param)
    return form.grammar
