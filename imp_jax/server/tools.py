"""Tool calling: each dialect's `tools` and `tool_choice` as one ToolPlan, the prompt that offers the tools,
and the grammar that enforces a `required` or named choice.

- Tools reach the model through the chat template's own tool support when it reads `tools`;
  otherwise (SmolLM2, most small models) through a system preamble in the Hermes convention, and
  replayed calls and tool results are rendered as Hermes text (`<tool_call>`, `<tool_response>`).
- The template also picks the call format the reply is parsed in (runtime/replies/tool_calls.py): Hermes/Qwen
  `<tool_call>`, Llama 3 JSON, Mistral `[TOOL_CALLS]`, or harmony (gpt-oss: a template with `<|channel|>`);
  Hermes when the template names none. A harmony reply's calls the engine reads itself (they are headers,
  not text): its events carry them as values (EngineEvent.answer, `event_answer`, `choice_reply`). Under harmony a `required` or named choice cannot be enforced by a
  grammar: a 400 `tool_choice_unenforceable` (prepare_decoding).
- `auto`: free text, parsed afterwards (and while streaming). `required` / a named tool: the reply
  is constrained by an llguidance grammar to one or more calls (one when parallel calls are off)
  whose arguments follow the tool's JSON schema; it is compiled like any output format
  (structured.constraint: off the event loop, cached). `none`: no tools in the prompt and no
  parsing (as vLLM). A choice that contradicts the tools is a 400 naming it.
- Beside an output format (response_format, text.format, output_config.format, ...): a forced
  call is a 400 naming the format's field; under `auto` the format wins and the request runs as
  `none` (`ToolPlan.admit`).

Conversations are handled in one shape, OpenAI Chat's messages: `tool_calls` on assistant turns
(`{"id", "type": "function", "function": {"name", "arguments": <JSON text>}}`), role `tool` results
with `tool_call_id`. Each dialect converts its own items into that shape.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.meta
import llguidance

from imp_jax.errors import InvalidRequestError
from imp_jax.runtime.api import Engine
from imp_jax.runtime.replies.call_parser import ToolCallParser
from imp_jax.runtime.replies.calls import ParsedReply, ParseEvent, collect_reply
from imp_jax.runtime.replies.tool_calls import PARSERS, answer_events, parse_reply
from imp_jax.runtime.request import EngineEvent, SamplingParams
from imp_jax.server import structured
from imp_jax.server.generation import Choice
from imp_jax.server.limits import field_limits
from imp_jax.server.structured import JSON_OPTIONS, OutputFormat, short_error

NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
NAMESPACE_SEP = "__"  # a Responses namespace's tool `t` in namespace `ns` is offered as `ns__t`
# Responses tool types run by OpenAI's own servers: dropped (the model is not told of them), not refused.
HOSTED_TOOL_TYPES = ("web_search", "tool_search", "file_search", "code_interpreter", "image_generation",
                     "computer_use", "mcp", "local_shell")
CUSTOM_PARAMETERS = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"],
                     "additionalProperties": False}

HERMES_PREAMBLE = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclasses.dataclass(frozen=True)
class Tool:
    """A tool as the model sees it. `name` is what it calls (a namespace's tools are `ns__name`)."""

    name: str
    description: str
    parameters: dict[str, Any]
    param: str                    # the request field of its schema (errors name it)
    name_param: str               # and of its name
    custom: bool = False          # a Responses custom tool: one free-text `input`
    namespace: str | None = None
    local_name: str = ""          # its name inside the namespace

    def as_function(self) -> dict[str, Any]:
        """OpenAI's function-tool shape, which chat templates and the preamble print."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclasses.dataclass
class ToolPlan:
    """A request's tools and how the reply may use them."""

    tools: list[Tool]
    choice: str = "auto"            # auto | none | required | named
    named: str | None = None        # the tool a named choice forces
    parallel: bool = True
    choice_param: str = "tool_choice"

    @property
    def offered(self) -> list[Tool]:
        """The tools the prompt shows (none when the choice is `none`)."""
        return [] if self.choice == "none" else self.tools

    @property
    def enforced(self) -> bool:
        return self.choice in ("required", "named") and bool(self.tools)

    def find(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)

    def check(self) -> None:
        """400 when the choice contradicts the tools; compiles an enforced choice's grammar (a bad schema is a 400)."""
        names = [t.name for t in self.tools]
        dup = next((i for i, n in enumerate(names) if n in names[:i]), None)
        if dup is not None:
            raise InvalidRequestError(f"two tools are named '{names[dup]}'", param=self.tools[dup].name_param)
        if self.choice == "required" and not self.tools:
            raise InvalidRequestError(f"'{self.choice_param}' requires a tool call but no tools are given",
                                      param=self.choice_param)
        if self.choice == "named" and self.find(self.named or "") is None:
            raise InvalidRequestError(f"'{self.choice_param}' names the tool '{self.named}', which is not among "
                                      "the tools", param=self.choice_param)
        if self.enforced:
            for tool in self._choosable():
                error = llguidance.LLMatcher.validate_grammar(_grammar("hermes", [tool], False))
                if error:
                    raise InvalidRequestError(f"the parameters of tool '{tool.name}' cannot be enforced: "
                                              f"{short_error(error)}", param=tool.param)

    def admit(self, form: OutputFormat | None) -> None:
        """The request's output format, if any, beside the tools. A forced call cannot also follow it: a 400
        naming the format's field. Under `auto` the format wins: the reply follows it, so it cannot hold a
        call, and the request runs as `none` (no tools in the prompt, no parsing)."""
        if form is None:
            return
        if self.enforced:
            raise InvalidRequestError(f"'{form.field}' and a forced tool call ('{self.choice_param}') cannot be "
                                      "combined: a reply cannot be both tool calls and that format", param=form.field)
        self.choice = "none"

    def adjust(self, params: SamplingParams, fmt: str) -> None:
        """What tools change in the sampling params: a Mistral reply keeps its `[TOOL_CALLS]` marker (a special
        token)."""
        if self.offered and fmt == "mistral":
            params.skip_special_tokens = False

    def _choosable(self) -> list[Tool]:
        return [t for t in self.tools if t.name == self.named] if self.choice == "named" else self.tools

    def output_format(self, fmt: str) -> OutputFormat | None:
        """The grammar a `required` or named choice decodes under, else None; structured.constraint compiles
        it as any output format (off the event loop, cached, a 400 before the stream). A harmony reply's
        call follows headers the engine reads outside any grammar (runtime/replies/harmony.py): not enforced there."""
        if not self.enforced or fmt == "harmony":
            return None
        return OutputFormat(_grammar(fmt, self._choosable(), self.parallel), self.choice_param, self.choice_param)

    def parser(self, fmt: str) -> ToolCallParser | None:
        """A fresh reply parser when tools are offered (None: the reply is plain text)."""
        return PARSERS[fmt]() if self.offered else None


def event_answer(parser: ToolCallParser | None, ev: EngineEvent) -> list[ParseEvent]:
    """An event's answer as parse events: the engine's own when it read the calls (EngineEvent.answer: a harmony
    reply with tools offered), else its text through `parser` (what it holds back flushed at the choice's end)."""
    if ev.answer is not None:
        return ev.answer
    return answer_events(parser, ev.text, ev.finish_reason is not None)


def choice_reply(c: Choice, fmt: str) -> ParsedReply:
    """A whole choice's content and valid calls: the engine's when it read them (Choice.answer), else its text
    parsed in `fmt`."""
    return collect_reply(c.answer) if c.answer is not None else parse_reply(c.text, fmt)


# --------------------------------------------------------------------------- the three dialects' fields
def _schema(value: Any, param: str) -> dict[str, Any]:
    if value is None:
        return {"type": "object", "properties": {}}
    if not isinstance(value, dict):
        raise InvalidRequestError(f"'{param}' must be a JSON schema object", param=param)
    return value


def _name(value: Any, param: str) -> str:
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise InvalidRequestError(f"'{param}' must be 1 to 128 letters, digits, '_', '-', '.' or ':'", param=param)
    return value


def _description(value: Any, param: str) -> str:
    if value is not None and not isinstance(value, str):
        raise InvalidRequestError(f"'{param}' must be a string", param=param)
    return value or ""


def _tool_list(tools: Any) -> list[Any]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidRequestError("'tools' must be a list", param="tools")
    limit = field_limits().tools
    if len(tools) > limit:
        raise InvalidRequestError(f"'tools' may hold at most {limit} tools (--max-tools)", param="tools")
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise InvalidRequestError(f"'tools[{i}]' must be an object", param=f"tools[{i}]")
    return tools


def chat_plan(tools: Any, tool_choice: Any, parallel: bool | None) -> ToolPlan:
    """Chat Completions: function tools; tool_choice none / auto / required / {"type": "function", ...}."""
    out = []
    for i, t in enumerate(_tool_list(tools)):
        if t.get("type", "function") != "function":
            raise InvalidRequestError(f"'tools[{i}].type' must be 'function'", param=f"tools[{i}].type")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise InvalidRequestError(f"'tools[{i}].function' must be an object", param=f"tools[{i}].function")
        p = f"tools[{i}].function"
        out.append(Tool(_name(fn.get("name"), f"{p}.name"), _description(fn.get("description"), f"{p}.description"),
                        _schema(fn.get("parameters"), f"{p}.parameters"), f"{p}.parameters", f"{p}.name"))
    plan = ToolPlan(out, parallel=parallel is not False)
    _openai_choice(plan, tool_choice, ("function",))
    return plan


def _openai_choice(plan: ToolPlan, choice: Any, kinds: Sequence[str]) -> None:
    """OpenAI's tool_choice (Chat: name under `function`; Responses: at the top)."""
    if choice is None or choice == "auto":
        return
    if choice in ("none", "required"):
        plan.choice = choice
        return
    if isinstance(choice, dict) and choice.get("type") in kinds:
        name = _function(choice).get("name") if "function" in choice else choice.get("name")
        plan.choice, plan.named = "named", _name(name, "tool_choice.name")
        return
    raise InvalidRequestError("'tool_choice' must be 'none', 'auto', 'required' or a named function",
                              param="tool_choice")


def anthropic_plan(tools: Any, tool_choice: Any) -> ToolPlan:
    """Messages: custom tools (`name`, `input_schema`); server tools (a `type` other than custom) are dropped.

    tool_choice: {"type": "auto" | "any" | "tool" (+ name) | "none", "disable_parallel_tool_use"}.
    """
    out = []
    for i, t in enumerate(_tool_list(tools)):
        if t.get("type", "custom") != "custom":
            continue  # Anthropic-run tools (web_search_..., bash_..., ...) the model here cannot use
        out.append(Tool(_name(t.get("name"), f"tools[{i}].name"), _description(t.get("description"),
                        f"tools[{i}].description"), _schema(t.get("input_schema"), f"tools[{i}].input_schema"),
                        f"tools[{i}].input_schema", f"tools[{i}].name"))
    plan = ToolPlan(out)
    if tool_choice is None:
        return plan
    if not isinstance(tool_choice, dict):
        raise InvalidRequestError("'tool_choice' must be an object", param="tool_choice")
    kind = tool_choice.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        raise InvalidRequestError("'tool_choice.type' must be 'auto', 'any', 'tool' or 'none'",
                                  param="tool_choice.type")
    plan.choice = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}[kind]
    if kind == "tool":
        plan.named = _name(tool_choice.get("name"), "tool_choice.name")
    plan.parallel = tool_choice.get("disable_parallel_tool_use") is not True
    return plan


def responses_plan(tools: Any, tool_choice: Any, parallel: bool | None) -> ToolPlan:
    """Responses: function and custom tools, namespaces flattened, hosted tools dropped; other types a 400."""
    out: list[Tool] = []
    for i, t in enumerate(_tool_list(tools)):
        kind = t.get("type")
        if kind == "namespace":
            ns = _name(t.get("name"), f"tools[{i}].name")
            for j, sub in enumerate(_tool_list(t.get("tools"))):
                out.append(_responses_tool(sub, f"tools[{i}].tools[{j}]", ns))
        elif isinstance(kind, str) and kind.startswith(HOSTED_TOOL_TYPES):
            continue
        else:
            out.append(_responses_tool(t, f"tools[{i}]", None))
    plan = ToolPlan(out, parallel=parallel is not False)
    _openai_choice(plan, tool_choice, ("function", "custom"))
    return plan


def _responses_tool(t: dict[str, Any], p: str, namespace: str | None) -> Tool:
    kind = t.get("type")
    if kind not in ("function", "custom"):
        raise InvalidRequestError(f"'{p}.type' {kind!r} is not supported: function and custom tools are, and "
                                  f"hosted tools ({', '.join(HOSTED_TOOL_TYPES)}) are ignored", param=f"{p}.type")
    name = _name(t.get("name"), f"{p}.name")
    full = f"{namespace}{NAMESPACE_SEP}{name}" if namespace else name
    description = _description(t.get("description"), f"{p}.description")
    if kind == "function":
        return Tool(full, description, _schema(t.get("parameters"), f"{p}.parameters"), f"{p}.parameters",
                    f"{p}.name", namespace=namespace, local_name=name)
    fmt = t.get("format") or {}
    if isinstance(fmt, dict) and fmt.get("type") == "grammar":
        description += (f"\n\nThe input is free text (not JSON) in this {fmt.get('syntax', 'lark')} grammar:\n"
                        f"{fmt.get('definition', '')}")
    return Tool(full, description, CUSTOM_PARAMETERS, f"{p}.format", f"{p}.name", custom=True,
                namespace=namespace, local_name=name)


# --------------------------------------------------------------------------- grammar
def _grammar(fmt: str, tools: Sequence[Tool], parallel: bool) -> str:
    """Lark (llguidance) for one call, or several when `parallel`, of `tools` in `fmt`'s markup.

    Nothing follows the last call: once the grammar is complete it allows every one of the model's
    EOS ids, end of turn included (runtime/decoding/constraints.py), as for any output format.
    """
    args_key = "parameters" if fmt == "llama3_json" else "arguments"
    bodies = [f"t{i}: %json{json.dumps(_call_schema(t, args_key))}" for i, t in enumerate(tools)]
    body = " | ".join(f"t{i}" for i in range(len(tools)))
    if fmt == "mistral":
        array = {"type": "array", "items": {"anyOf": [_call_schema(t, args_key) for t in tools]}, "minItems": 1,
                 **({} if parallel else {"maxItems": 1}), "x-guidance": JSON_OPTIONS}
        return f'start: "[TOOL_CALLS]" calls\ncalls: %json{json.dumps(array)}\n'
    if fmt == "llama3_json":
        call, sep = "call: body", '"; "'
    else:
        call, sep = 'call: "<tool_call>\\n" body "\\n</tool_call>"', '"\\n"'
    calls = f"call ({sep} call)*" if parallel else "call"
    return "\n".join([f"start: {calls}", call, f"body: {body}", *bodies]) + "\n"


def _call_schema(tool: Tool, args_key: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": tool.name}, args_key: _closed(tool.parameters)},
            "required": ["name", args_key], "additionalProperties": False, "x-guidance": JSON_OPTIONS}


def _closed(schema: Any) -> Any:
    """`schema` with objects that list their properties closed to others unless it says otherwise (as
    OpenAI's strict mode): what it then allows still validates against `schema`, minus invented keys."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("const", "enum", "default", "examples") else _closed(v)) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


# --------------------------------------------------------------------------- prompt
@dataclasses.dataclass(frozen=True)
class TemplateTools:
    """What a chat template does with tools: renders them itself (`native`), and the call format it teaches."""

    native: bool
    fmt: str


@functools.lru_cache(maxsize=16)
def template_tools(source: str | None) -> TemplateTools:
    if not source:
        return TemplateTools(False, "hermes")
    try:
        native = "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(source))
    except jinja2.TemplateError:
        native = False
    if "<|channel|>" in source and "<|message|>" in source:
        fmt = "harmony"
    elif "[TOOL_CALLS]" in source:
        fmt = "mistral"
    elif "<tool_call>" in source:
        fmt = "hermes"
    elif "<|python_tag|>" in source or "<|eom_id|>" in source:
        fmt = "llama3_json"
    else:
        fmt = "hermes"
    return TemplateTools(native, fmt)


def tokenizer_tools(tokenizer: Any) -> TemplateTools:
    """The template a request with tools renders with (HF: a "tool_use" template if there is one)."""
    templates = getattr(tokenizer, "chat_templates", None) or {}
    return template_tools(templates.get("tool_use") or tokenizer.chat_template)


async def prepare_decoding(plan: ToolPlan, form: OutputFormat | None, engine: Engine,
                           params: SamplingParams) -> tuple[str | None, str | None]:
    """A chat-style request's (constraint, tool_format): the grammar it decodes under, the output format's or a
    forced call's (at most one: `ToolPlan.admit`), compiled off the event loop by structured.constraint; and
    the call format its reply is parsed in (None: not parsed for calls)."""
    call_format = tokenizer_tools(engine.tokenizer).fmt
    if plan.enforced and call_format == "harmony":   # a harmony call's headers are read outside any grammar
        raise InvalidRequestError(f"'{plan.choice_param}' forces a tool call, which this model's harmony format "
                                  "cannot be constrained to; send 'auto' (the reply is parsed for calls)",
                                  code="tool_choice_unenforceable", param=plan.choice_param)
    plan.adjust(params, call_format)
    constraint = await structured.constraint(form or plan.output_format(call_format), engine, params)
    return constraint, call_format if plan.offered else None


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]], plan: ToolPlan | None, **kwargs: Any) -> str:
    """The conversation as prompt text: tools, replayed calls and results through the template's own
    tool support, or as Hermes text when it has none. `kwargs` go to the template. The text is
    `Tokenizer.render_chat`'s: tokenize it with `encode_chat` (message text never becomes control tokens)."""
    support = tokenizer_tools(tokenizer)
    offered = plan.offered if plan is not None else []
    if support.native:
        tools = [t.as_function() for t in offered] or None
        return tokenizer.render_chat(native_messages(messages, support.fmt), tools=tools, **kwargs)
    return tokenizer.render_chat(hermes_messages(messages, offered), **kwargs)


def _function(call: Any) -> dict[str, Any]:
    """A call's (or a choice's) `function` object; {} when it is missing or not an object."""
    fn = call.get("function") if isinstance(call, Mapping) else None
    return fn if isinstance(fn, dict) else {}


def _arguments_object(arguments: Any) -> Any:
    """A call's arguments as an object (templates print them with tojson), when the JSON text parses."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def native_messages(messages: list[dict[str, Any]], fmt: str = "hermes") -> list[dict[str, Any]]:
    """Messages for a template with tool support: call arguments as objects (as vLLM hands them over).
    A harmony template (gpt-oss) reads replayed reasoning from `thinking`, and refuses it beside content
    in a turn with calls: there the content (a preamble) gives way, as llama.cpp does."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = copy.deepcopy(m)
            for call in m["tool_calls"]:
                fn = _function(call)
                if "arguments" in fn:
                    fn["arguments"] = _arguments_object(fn["arguments"])
        if fmt == "harmony" and m.get("role") == "assistant":
            reasoning = m.get("thinking") or m.get("reasoning_content") or m.get("reasoning")
            if reasoning:
                m = {k: v for k, v in m.items() if k not in ("reasoning_content", "reasoning")}
                m["thinking"] = reasoning
                if m.get("tool_calls"):
                    m.pop("content", None)
        out.append(m)
    return out


def hermes_call_text(name: str, arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": _arguments_object(arguments)},
                                        ensure_ascii=False) + "\n</tool_call>"


def hermes_messages(messages: list[dict[str, Any]], tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """Messages for a template without tool support: the tools as a system preamble, calls as
    `<tool_call>` text in the assistant turn, results as one user turn of `<tool_response>` blocks."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = [hermes_call_text(_function(c).get("name", ""), _function(c).get("arguments", {}))
                     for c in m["tool_calls"]]
            rest = {k: v for k, v in m.items() if k != "tool_calls"}   # replayed reasoning stays
            out.append({**rest, "content": "\n".join(filter(None, [content, *calls]))})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
    for m in out:
        m.pop("tool_results", None)
    if tools:
        listing = "\n".join(json.dumps(t.as_function(), ensure_ascii=False) for t in tools)
        preamble = HERMES_PREAMBLE.format(tools=listing)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{preamble}" if out[0]["content"] else preamble}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out
