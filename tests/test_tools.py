"""Tool calling (server/tools.py): the three dialects' tools and tool_choice, the prompt, the enforcing
grammar; live on SmolLM2 through the `openai` and `anthropic` packages: enforced calls validate against
their schemas, streamed and not, round trips on every dialect, the Responses custom tool, and 400s."""
from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import jsonschema
import llguidance
import openai
import pytest
from support.servers import (MODEL, LiveServer, fake_tokenizer, live_server, openai_client,  # noqa: F401
                             parse_sse, wait_idle)

from imp_jax.errors import InvalidRequestError
from imp_jax.runtime.request import EngineEvent, Usage
from imp_jax.server.anthropic_reply import MessageStream
from imp_jax.server.chat_completions import ChatRequest, ChatStream
from imp_jax.server.logprobs import TokenText
from imp_jax.server.reasoning import Thinking
from imp_jax.server.responses import ResponsesRequest
from imp_jax.server.responses_reply import ResponseDraft, ResponseStream
from imp_jax.server.responses_store import ResponsesStore
from imp_jax.model.text.chat_template import render_chat_template
from imp_jax.runtime.replies.tool_calls import parse_reply
from imp_jax.server.tools import (anthropic_plan, chat_plan, hermes_messages, native_messages, responses_plan,
                                  template_tools)

real = pytest.mark.real_model
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
ALARM = {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                          "label": {"type": "string", "maxLength": 20}},
         "required": ["hour"]}
SCHEMAS = {"get_weather": WEATHER, "set_alarm": ALARM}
CHAT_TOOLS = [{"type": "function", "function": {"name": n, "description": d, "parameters": SCHEMAS[n]}}
              for n, d in (("get_weather", "Current weather in a city"), ("set_alarm", "Set an alarm clock"))]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in CHAT_TOOLS]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
QUESTION = "What is the weather in Paris?"
RESULT = "It is 22 degrees and sunny in Paris."


# --------------------------------------------------------------------------- normalisation, no server
def test_choices_map_to_one_plan_on_every_dialect() -> None:
    chat = chat_plan(CHAT_TOOLS, {"type": "function", "function": {"name": "set_alarm"}}, False)
    msgs = anthropic_plan(ANTHROPIC_TOOLS, {"type": "tool", "name": "set_alarm", "disable_parallel_tool_use": True})
    resp = responses_plan(RESPONSES_TOOLS, {"type": "function", "name": "set_alarm"}, False)
    for plan in (chat, msgs, resp):
        plan.check()
        assert (plan.choice, plan.named, plan.parallel) == ("named", "set_alarm", False)
        assert [t.name for t in plan.tools] == ["get_weather", "set_alarm"] and plan.enforced
    assert anthropic_plan(ANTHROPIC_TOOLS, {"type": "any"}).choice == "required"
    none = chat_plan(CHAT_TOOLS, "none", None)
    assert none.offered == [] and none.output_format("hermes") is None and none.parser("hermes") is None


def test_responses_tools_drop_hosted_and_flatten_namespaces() -> None:
    plan = responses_plan([{"type": "web_search_preview"}, {"type": "file_search", "vector_store_ids": []},
                           {"type": "mcp", "server_label": "x"},
                           {"type": "custom", "name": "apply_patch", "description": "Patch files",
                            "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
                           {"type": "namespace", "name": "fs", "tools": [RESPONSES_TOOLS[0]]}], "auto", None)
    plan.check()
    patch, weather = plan.tools
    assert patch.custom and patch.parameters["required"] == ["input"] and "start: /.+/" in patch.description
    assert (weather.name, weather.namespace, weather.local_name) == ("fs__get_weather", "fs", "get_weather")
    assert anthropic_plan([{"type": "web_search_20250305", "name": "web_search"}, *ANTHROPIC_TOOLS], None).tools[0] \
        .name == "get_weather"


@pytest.mark.parametrize("build, param", [
    (lambda: chat_plan([], "required", None), "tool_choice"),
    (lambda: chat_plan(CHAT_TOOLS, {"type": "function", "function": {"name": "nope"}}, None), "tool_choice"),
    (lambda: chat_plan(CHAT_TOOLS, "sometimes", None), "tool_choice"),
    (lambda: chat_plan([{"type": "retrieval"}], None, None), "tools[0].type"),
    (lambda: chat_plan([{"type": "function", "function": {"name": "a b"}}], None, None), "tools[0].function.name"),
    (lambda: chat_plan([CHAT_TOOLS[0], CHAT_TOOLS[0]], None, None), "tools[1].function.name"),
    (lambda: chat_plan([{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
                       "required", None), "tools[0].function.parameters"),
    (lambda: anthropic_plan(ANTHROPIC_TOOLS, {"type": "tool", "name": "nope"}), "tool_choice"),
    (lambda: anthropic_plan(None, {"type": "any"}), "tool_choice"),
    (lambda: anthropic_plan(ANTHROPIC_TOOLS, {"type": "sometimes"}), "tool_choice.type"),
    (lambda: responses_plan([{"type": "web_search"}], "required", None), "tool_choice"),
    (lambda: responses_plan([{"type": "computer"}], None, None), "tools[0].type"),
    (lambda: responses_plan(RESPONSES_TOOLS, {"type": "custom", "name": "get_time"}, None), "tool_choice"),
])
def test_contradictory_or_bad_tools_are_400s_naming_the_field(build: Callable[[], Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        build().check()
    assert e.value.param == param


def test_an_output_format_beside_tools_wins_under_auto_and_refuses_a_forced_call() -> None:
    """With an output format, `auto` runs as `none` (no tools in the prompt, no parsing, the format's grammar);
    a forced call is a 400 naming the format's field."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "tools": CHAT_TOOLS,
            "guided_choice": ["yes", "no"]}
    req = ChatRequest.model_validate(body)
    req.check()
    assert req.tool_plan.offered == [] and req.tool_plan.parser("hermes") is None
    assert req.output_form.field == "guided_choice" and req.tool_plan.output_format("hermes") is None
    for choice in ("required", {"type": "function", "function": {"name": "set_alarm"}}):
        with pytest.raises(InvalidRequestError) as e:
            ChatRequest.model_validate({**body, "tool_choice": choice}).check()
        assert e.value.param == "guided_choice" and "cannot be combined" in e.value.message


def _accepts(grammar: str, text: str) -> bool:
    """Whether `grammar` takes `text` whole (tokenized with a small byte-level BPE)."""
    tok, llt = _BYTE_TOKENIZER
    m = llguidance.LLMatcher(llt, grammar)
    assert not m.is_error(), m.get_error()
    return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_accepting()


_TOK = fake_tokenizer()
_BYTE_TOKENIZER = (_TOK, llguidance.LLTokenizer(_TOK.backend.to_str(), n_vocab=_TOK.vocab_size, eos_token=_TOK.eos_id))


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
def test_grammar_accepts_exactly_calls_that_parse_into_valid_arguments(fmt: str) -> None:
    """The enforced grammar of every format compiles, takes the format's calls, and refuses a bad argument."""
    plan = chat_plan(CHAT_TOOLS, "required", True)
    grammar = plan.output_format(fmt).grammar
    good = {"hermes": '<tool_call>\n{"name": "set_alarm", "arguments": {"hour": 7}}\n</tool_call>\n'
                      '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
                      '</tool_call>',
            "llama3_json": '{"name": "set_alarm", "parameters": {"hour": 7}}; '
                           '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}',
            "mistral": '[TOOL_CALLS][{"name": "set_alarm", "arguments": {"hour": 7}}, '
                       '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]'}[fmt]
    assert _accepts(grammar, good)
    assert not _accepts(grammar, good.replace('"hour": 7', '"hour": 24'))       # maximum 23
    assert not _accepts(grammar, good.replace('"celsius"', '"kelvin"'))         # not in the enum
    assert not _accepts(grammar, good.replace('"hour": 7', '"hour": 7, "x": 1'))  # no invented keys
    assert not _accepts(chat_plan(CHAT_TOOLS, "required", False).output_format(fmt).grammar, good)  # one call only
    calls = parse_reply(good, fmt).calls
    assert [c.name for c in calls] == ["set_alarm", "get_weather"]
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])


def test_template_decides_native_tools_and_call_format() -> None:
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    qwen = "{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}<tool_call>{% endif %}" + chatml
    assert template_tools(chatml) == template_tools(None) and not template_tools(chatml).native
    assert template_tools(qwen).native and template_tools(qwen).fmt == "hermes"
    assert template_tools("{{ tools }}[TOOL_CALLS]").fmt == "mistral"
    assert template_tools("{{ tools }}<|python_tag|>").fmt == "llama3_json"


def test_hermes_rendering_of_tools_calls_and_results() -> None:
    plan = chat_plan(CHAT_TOOLS, "auto", None)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": RESULT},
                {"role": "tool", "tool_call_id": "call_2", "content": "second"}]
    out = hermes_messages(messages, plan.offered)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and '"name": "set_alarm"' in out[0]["content"]
    assert out[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                                 '"unit": "celsius"}}\n</tool_call>')
    assert out[3]["content"] == (f"<tool_response>\n{RESULT}\n</tool_response>\n"
                                 "<tool_response>\nsecond\n</tool_response>")
    assert all(set(m) == {"role", "content"} for m in out)
    native = native_messages(messages)
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "celsius"}
    assert messages[2]["tool_calls"][0]["function"]["arguments"].startswith("{")  # the request is not changed
    rendered = render_chat_template("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}", out)
    assert "# Tools" in rendered and "<tool_response>" in rendered


# --------------------------------------------------------------------------- stream formatters, text around calls
MIXED = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
         '\n</tool_call>\n<tool_call>\n{"name": "set_alarm", "arguments": {"hour": 7}}\n</tool_call> Done.')


def _events(text: str, size: int = 3) -> list[EngineEvent]:
    """The engine's events for `text` in chunks of `size` characters, the last one finishing the request."""
    chunks = [text[i:i + size] for i in range(0, len(text), size)]
    events = [EngineEvent("r", text=c) for c in chunks]
    events[-1].finish_reason, events[-1].done, events[-1].usage = "stop", True, Usage(5, len(chunks), 0)
    return events


def _frames(fmt: Any, events: list[EngineEvent]) -> list[dict[str, Any]]:
    raw = fmt.open() + [f for ev in events for f in fmt.event(ev)] + fmt.close(events[-1].usage)
    return [json.loads(d) for _, d in parse_sse("".join(raw)) if d != "[DONE]"]


def test_chat_stream_of_text_around_calls() -> None:
    frames = _frames(ChatStream("r", MODEL, 1, False, TokenText(_TOK), "hermes"), _events(MIXED))
    deltas = [f["choices"][0]["delta"] for f in frames]
    content = "".join(d.get("content") or "" for d in deltas)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            calls.setdefault(tc["index"], [tc["function"].get("name"), ""])[1] += tc["function"]["arguments"]
    assert content == "Let me check. Done." and frames[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert [(n, json.loads(a)) for n, a in calls.values()] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("set_alarm", {"hour": 7})]


def test_messages_stream_of_text_around_calls() -> None:
    frames = _frames(MessageStream("m", MODEL, 5, False, "hermes"), _events(MIXED))
    starts = [f["content_block"] for f in frames if f["type"] == "content_block_start"]
    assert [b["type"] for b in starts] == ["text", "tool_use", "tool_use", "text"]
    assert [f["index"] for f in frames if f["type"] == "content_block_stop"] == [0, 1, 2, 3]
    inputs = ["".join(f["delta"]["partial_json"] for f in frames
                      if f["type"] == "content_block_delta" and f["index"] == i) for i in (1, 2)]
    assert [json.loads(x) for x in inputs] == [{"city": "Paris", "unit": "celsius"}, {"hour": 7}]
    assert frames[-2]["delta"]["stop_reason"] == "tool_use"


def test_responses_stream_of_text_around_calls() -> None:
    req = ResponsesRequest.model_validate({"model": MODEL, "input": QUESTION, "tools": RESPONSES_TOOLS,
                                           "store": False})
    draft = ResponseDraft("resp_1", MODEL, req, [], ResponsesStore())
    frames = _frames(ResponseStream(draft, "hermes"), _events(MIXED))
    assert [f["sequence_number"] for f in frames] == list(range(len(frames)))
    added = [(f["output_index"], f["item"]["type"]) for f in frames if f["type"] == "response.output_item.added"]
    assert added == [(0, "message"), (1, "function_call"), (2, "function_call"), (3, "message")]
    final = frames[-1]["response"]
    assert final["status"] == "completed" and [o["type"] for o in final["output"]] == [
        "message", "function_call", "function_call", "message"]
    assert final["output"][0]["content"][0]["text"] == "Let me check." and final["output"][3]["content"][0][
        "text"] == " Done."
    args = "".join(f["delta"] for f in frames if f["type"] == "response.function_call_arguments.delta"
                   and f["output_index"] == 1)
    assert json.loads(args) == {"city": "Paris", "unit": "celsius"} == json.loads(final["output"][1]["arguments"])
    assert len({o["id"] for o in final["output"]}) == 4


# --------------------------------------------------------------------------- stream formatters, reasoning first
THOUGHT = 'Maybe <tool_call>\n{"name": "set_alarm", "arguments": {"hour": 1}}\n</tool_call> then.'


def _thinking_events() -> list[EngineEvent]:
    """A thinking model's events: reasoning (with call markup that is no call), then MIXED as the answer."""
    return [EngineEvent("r", reasoning_text=THOUGHT[i:i + 4]) for i in range(0, len(THOUGHT), 4)] + _events(MIXED)


def test_stream_formatters_put_reasoning_first_and_parse_calls_in_the_answer_only() -> None:
    frames = _frames(ChatStream("r", MODEL, 1, False, TokenText(_TOK), "hermes"), _thinking_events())
    deltas = [f["choices"][0]["delta"] for f in frames]
    kinds = [k for d in deltas for k in ("reasoning_content", "content", "tool_calls") if d.get(k)]
    answer = kinds.index("content")
    assert answer > 0 and set(kinds[:answer]) == {"reasoning_content"} and "reasoning_content" not in kinds[answer:]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == THOUGHT
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check. Done."
    assert len({tc["index"] for d in deltas for tc in d.get("tool_calls", [])}) == 2

    frames = _frames(MessageStream("m", MODEL, 5, False, "hermes", Thinking(enabled=True)), _thinking_events())
    starts = [(f["index"], f["content_block"]["type"]) for f in frames if f["type"] == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text"), (2, "tool_use"), (3, "tool_use"), (4, "text")]
    assert [f["index"] for f in frames if f["type"] == "content_block_stop"] == [0, 1, 2, 3, 4]
    thinking = [f["delta"] for f in frames if f["type"] == "content_block_delta" and f["index"] == 0]
    assert "".join(d.get("thinking", "") for d in thinking) == THOUGHT and thinking[-1]["type"] == "signature_delta"
    assert frames[-2]["delta"]["stop_reason"] == "tool_use"

    req = ResponsesRequest.model_validate({"model": MODEL, "input": QUESTION, "tools": RESPONSES_TOOLS,
                                           "store": False})
    draft = ResponseDraft("resp_1", MODEL, req, [], ResponsesStore())
    frames = _frames(ResponseStream(draft, "hermes"), _thinking_events())
    assert [f["sequence_number"] for f in frames] == list(range(len(frames)))
    added = [(f["output_index"], f["item"]["type"]) for f in frames if f["type"] == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "message"), (2, "function_call"), (3, "function_call"), (4, "message")]
    done = [f["output_index"] for f in frames if f["type"] == "response.output_item.done"]
    assert done == [0, 1, 2, 3, 4]
    final = frames[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call", "function_call",
                                                    "message"]
    assert final["output"][0]["content"][0]["text"] == THOUGHT and final["output"][1]["id"] == draft.item_id
    assert len({o["id"] for o in final["output"]}) == 5


# --------------------------------------------------------------------------- live: enforced calls on every dialect
def _check_calls(calls: list[tuple[str, Any]], named: str | None) -> None:
    """At least one call, each to a known tool (the named one, if any) with arguments valid for its schema."""
    assert calls, "no tool call"
    for name, args in calls:
        assert name == named if named else name in SCHEMAS
        jsonschema.validate(json.loads(args) if isinstance(args, str) else args, SCHEMAS[name])


def _chat_calls(client: openai.OpenAI, choice: Any, stream: bool, parallel: bool) -> list[tuple[str, str]]:
    body = dict(model=MODEL, messages=[{"role": "user", "content": QUESTION}], tools=CHAT_TOOLS, tool_choice=choice,
                temperature=0, max_tokens=160, parallel_tool_calls=parallel)
    if not stream:
        r = client.chat.completions.create(**body)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        assert all(c.id.startswith("call_") and c.type == "function" for c in r.choices[0].message.tool_calls)
        return [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**body, stream=True):
        for choice_delta in chunk.choices:
            assert not choice_delta.delta.content
            for tc in choice_delta.delta.tool_calls or []:
                if tc.index not in calls:  # the first delta of a call: id and name, empty arguments
                    assert tc.id.startswith("call_") and tc.function.name and tc.function.arguments == ""
                    calls[tc.index] = [tc.function.name, ""]
                else:
                    assert tc.id is None and tc.function.name is None
                    calls[tc.index][1] += tc.function.arguments
            finish = choice_delta.finish_reason or finish
    assert finish == "tool_calls" and sorted(calls) == list(range(len(calls)))
    return [(n, a) for n, a in calls.values()]


def _messages_calls(client: anthropic.Anthropic, choice: dict[str, Any], stream: bool,
                    parallel: bool) -> list[tuple[str, dict]]:
    body = dict(model=MODEL, max_tokens=160, extra_body={"temperature": 0},
                messages=[{"role": "user", "content": QUESTION}], tools=ANTHROPIC_TOOLS,
                tool_choice={**choice, "disable_parallel_tool_use": not parallel})
    if stream:
        with client.messages.stream(**body) as s:
            m = s.get_final_message()
    else:
        m = client.messages.create(**body)
    assert m.stop_reason == "tool_use" and all(b.type == "tool_use" for b in m.content)
    assert all(b.id.startswith("toolu_") for b in m.content)
    return [(b.name, b.input) for b in m.content]


def _responses_calls(client: openai.OpenAI, choice: Any, stream: bool, parallel: bool) -> list[tuple[str, str]]:
    body = dict(model=MODEL, input=QUESTION, tools=RESPONSES_TOOLS, tool_choice=choice, temperature=0,
                max_output_tokens=160, parallel_tool_calls=parallel)
    if stream:
        with client.responses.stream(**body) as s:
            kinds = [e.type for e in s]
            r = s.get_final_response()
        assert kinds.count("response.function_call_arguments.done") == len(r.output)
        assert kinds.count("response.output_item.added") == len(r.output)
    else:
        r = client.responses.create(**body)
    assert r.status == "completed" and all(o.type == "function_call" and o.status == "completed" for o in r.output)
    return [(o.name, o.arguments) for o in r.output]


@pytest.fixture(scope="module")
def anthropic_client(live_server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live_server.url, api_key="unused", max_retries=0, timeout=300)


@real
def test_enforced_choices_give_valid_calls_on_every_dialect(live_server: LiveServer, openai_client: openai.OpenAI,
                                                             anthropic_client: anthropic.Anthropic) -> None:
    """required and named, streamed and not, parallel calls on and off, on the three dialects, concurrently."""
    runs = []
    for stream in (False, True):
        for named in (None, "set_alarm"):
            parallel = named is None
            runs += [
                (named, lambda s=stream, n=named, p=parallel: _chat_calls(
                    openai_client, {"type": "function", "function": {"name": n}} if n else "required", s, p)),
                (named, lambda s=stream, n=named, p=parallel: _messages_calls(
                    anthropic_client, {"type": "tool", "name": n} if n else {"type": "any"}, s, p)),
                (named, lambda s=stream, n=named, p=parallel: _responses_calls(
                    openai_client, {"type": "function", "name": n} if n else "required", s, p)),
            ]
    with ThreadPoolExecutor(len(runs)) as pool:
        results = list(pool.map(lambda run: (run[0], run[1]()), runs))
    for i, (named, calls) in enumerate(results):
        _check_calls(calls, named)
        if named:  # parallel calls off
            assert len(calls) == 1, (i, calls)
    wait_idle(live_server.url)


# --------------------------------------------------------------------------- live: round trips
def _chat_round_trip(client: openai.OpenAI) -> str:
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS, temperature=0,
                                       max_tokens=80, tool_choice={"type": "function",
                                                                   "function": {"name": "get_weather"}})
    messages += [r.choices[0].message.model_dump(exclude_none=True),
                 *({"role": "tool", "tool_call_id": call.id, "content": RESULT}
                   for call in r.choices[0].message.tool_calls)]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=30)
    assert final.choices[0].message.tool_calls is None
    return final.choices[0].message.content


def _messages_round_trip(client: anthropic.Anthropic) -> str:
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    m = client.messages.create(model=MODEL, max_tokens=80, extra_body={"temperature": 0}, messages=messages,
                               tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "get_weather"})
    uses = [b for b in m.content if b.type == "tool_use"]
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}
                                              for use in uses]}]
    final = client.messages.create(model=MODEL, max_tokens=30, extra_body={"temperature": 0}, messages=messages,
                                   tools=ANTHROPIC_TOOLS, tool_choice={"type": "none"})
    assert final.stop_reason in ("end_turn", "max_tokens") and [b.type for b in final.content] == ["text"]
    return final.content[0].text


def _responses_round_trip(client: openai.OpenAI) -> str:
    """The call comes back through previous_response_id, its output as a function_call_output item."""
    r = client.responses.create(model=MODEL, input=QUESTION, tools=RESPONSES_TOOLS, temperature=0,
                                max_output_tokens=80, tool_choice={"type": "function", "name": "get_weather"})
    assert r.output and {o.type for o in r.output} == {"function_call"}
    final = client.responses.create(model=MODEL, previous_response_id=r.id, tools=RESPONSES_TOOLS, tool_choice="none",
                                    temperature=0, max_output_tokens=30,
                                    input=[{"type": "function_call_output", "call_id": call.call_id, "output": RESULT}
                                           for call in r.output])
    assert [o.type for o in final.output] == ["message"]
    return final.output_text


def _custom_round_trip(client: openai.OpenAI) -> str:
    """Codex's apply_patch: a custom tool's call is a custom_tool_call with free-text input; its output is
    replayed without the store, with the call, as custom_tool_call_output."""
    tools = [{"type": "custom", "name": "apply_patch", "description": "Apply a patch to the files",
              "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /(.|\\n)*/'}},
             {"type": "web_search"}]
    ask = [{"role": "user", "content": "Add a line 'hello' to README.md."}]
    r = client.responses.create(model=MODEL, input=ask, tools=tools, temperature=0, max_output_tokens=120,
                                tool_choice={"type": "custom", "name": "apply_patch"}, store=False,
                                parallel_tool_calls=False)
    (call,) = r.output
    assert call.type == "custom_tool_call" and call.name == "apply_patch" and isinstance(call.input, str)
    replay = [*ask, {"type": "custom_tool_call", "call_id": call.call_id, "name": call.name, "input": call.input},
              {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done!"}]
    final = client.responses.create(model=MODEL, input=replay, tools=tools, temperature=0, max_output_tokens=30,
                                    store=False, tool_choice="none")
    assert [o.type for o in final.output] == ["message"]
    return final.output_text


@real
def test_round_trips_call_result_answer(live_server: LiveServer, openai_client: openai.OpenAI,
                                        anthropic_client: anthropic.Anthropic) -> None:
    trips = [lambda: _chat_round_trip(openai_client), lambda: _messages_round_trip(anthropic_client),
             lambda: _responses_round_trip(openai_client), lambda: _custom_round_trip(openai_client)]
    with ThreadPoolExecutor(len(trips)) as pool:
        answers = list(pool.map(lambda trip: trip(), trips))
    assert all(a.strip() and "<tool_call>" not in a for a in answers), answers
    wait_idle(live_server.url)


# --------------------------------------------------------------------------- live: 400s in each envelope
CONTRADICTIONS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": CHAT_TOOLS,
                              "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": CHAT_TOOLS,
                              "tool_choice": "required", "ignore_eos": True}, "ignore_eos"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tools": ANTHROPIC_TOOLS,
                      "tool_choice": {"type": "tool", "name": "get_time"}}, "tool_choice"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "content": "x"}]}]}, "messages[0].content[0].tool_use_id"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "web_search"}], "tool_choice": "required"}, "tool_choice"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "computer", "display_width": 5}]}, "tools[0].type"),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
]


# A forced call beside an output format, on every dialect and format field: a 400 naming that field.
FORCED_WITH_FORMAT = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": CHAT_TOOLS,
                              "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": CHAT_TOOLS, "stream": True,
                              "tool_choice": {"type": "function", "function": {"name": "set_alarm"}},
                              "guided_regex": "[0-9]+"}, "guided_regex"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tools": ANTHROPIC_TOOLS,
                      "tool_choice": {"type": "any"}, "output_config": {"format": {"type": "json_schema",
                                                                                   "schema": WEATHER}}},
     "output_config.format"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tools": ANTHROPIC_TOOLS,
                      "stream": True, "tool_choice": {"type": "tool", "name": "set_alarm"},
                      "output_config": {"format": {"type": "json_schema", "schema": ALARM}}}, "output_config.format"),
    ("/v1/responses", {"input": "hi", "tools": RESPONSES_TOOLS, "tool_choice": "required",
                       "text": {"format": {"type": "json_object"}}}, "text.format"),
    ("/v1/responses", {"input": "hi", "tools": RESPONSES_TOOLS, "stream": True,
                       "tool_choice": {"type": "function", "name": "set_alarm"},
                       "text": {"format": {"type": "json_schema", "name": "w", "schema": WEATHER}}}, "text.format"),
]


@real
@pytest.mark.parametrize("path, body, param", FORCED_WITH_FORMAT)
def test_a_forced_call_with_an_output_format_is_a_400_naming_the_format(live_server: LiveServer, path: str,
                                                                        body: dict[str, Any], param: str) -> None:
    r = httpx.post(live_server.url + path, json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and f"'{param}'" in err["message"], err
    assert "cannot be combined" in err["message"] and (path == "/v1/messages" or err["param"] == param), err


@real
def test_auto_tools_with_an_output_format_give_the_format_not_calls(openai_client: openai.OpenAI) -> None:
    """tool_choice auto beside response_format: the format wins, the reply is the JSON and holds no calls."""
    schema = {"type": "object", "properties": {"weather": {"enum": ["sunny", "rainy", "cloudy"]}},
              "required": ["weather"], "additionalProperties": False}
    r = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], tools=CHAT_TOOLS, tool_choice="auto",
        temperature=0, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls, choice
    jsonschema.validate(json.loads(choice.message.content), schema)


@real
@pytest.mark.parametrize("path, body, param", CONTRADICTIONS)
def test_contradictory_tool_choice_is_a_400(live_server: LiveServer, path: str, body: dict[str, Any],
                                            param: str) -> None:
    r = httpx.post(live_server.url + path, json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    if path == "/v1/messages":
        assert err["type"] == "invalid_request_error" and f"'{param}'" in err["message"]
    else:
        assert err["param"] == param, err
