"""Structured output end to end on the real engine (SmolLM2) through the official `openai` and `anthropic`
packages: twenty JSON schemas on Chat, Responses and Messages, streamed and not; regex, GBNF, Lark and
choices; the 400s naming the field; length cuts; logprobs of the masked distribution; the KV pool after."""
from __future__ import annotations

import concurrent.futures
import json
import re
from typing import Any, Callable

import anthropic
import jsonschema
import openai
import pydantic
import pytest
from support.servers import MODEL, LiveServer, engine_stats, live_server, openai_client, wait_idle  # noqa: F401
from support.structured_schemas import SCHEMAS

from imp_jax.server import structured
from imp_jax.server.limits import FieldLimits

real = pytest.mark.real_model
SYSTEM = "Reply with JSON only."
MAX_TOKENS = 160  # far above what any schema's bounded output takes: a reply cut by length is a failure
MASKED_LOGPROB = -9999.0  # JSON has no -Infinity: a token the grammar masks (probability 0) reads as this


@pytest.fixture(scope="module")
def anthropic_client(live_server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live_server.url, api_key="unused", max_retries=0, timeout=300)


def _messages(ask: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ask}]


# --------------------------------------------------------------------------- one request per dialect
def _chat(client: openai.OpenAI, name: str, ask: str, schema: dict[str, Any], stream: bool) -> tuple[str, str]:
    """(text, finish) of a json_schema Chat request."""
    kw = dict(model=MODEL, messages=_messages(ask), temperature=0, max_tokens=MAX_TOKENS,
              response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        return choice.message.content, choice.finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


def _responses(client: openai.OpenAI, name: str, ask: str, schema: dict[str, Any], stream: bool) -> tuple[str, str]:
    """(text, status) of a Responses request with text.format json_schema."""
    kw = dict(model=MODEL, instructions=SYSTEM, input=ask, temperature=0, max_output_tokens=MAX_TOKENS,
              text={"format": {"type": "json_schema", "name": name, "schema": schema, "strict": True}})
    if not stream:
        r = client.responses.create(**kw)
        return r.output_text, r.status
    text, final = "", None
    for ev in client.responses.create(**kw, stream=True):
        if ev.type == "response.output_text.delta":
            text += ev.delta
        elif ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert final is not None and final.output_text == text
    assert final.text.format.type == "json_schema"  # the response echoes the format asked for
    return text, final.status


def _messages_api(client: anthropic.Anthropic, name: str, ask: str, schema: dict[str, Any],
                  stream: bool) -> tuple[str, str]:
    """(text, stop_reason) of a Messages request with output_config.format."""
    kw = dict(model=MODEL, max_tokens=MAX_TOKENS, system=SYSTEM, messages=[{"role": "user", "content": ask}],
              output_config={"format": {"type": "json_schema", "schema": schema}}, extra_body={"temperature": 0})
    if not stream:
        m = client.messages.create(**kw)
    else:
        with client.messages.stream(**kw) as s:
            m = s.get_final_message()
    return "".join(b.text for b in m.content), m.stop_reason


DONE = {"chat": "stop", "responses": "completed", "messages": "end_turn"}


# --------------------------------------------------------------------------- JSON schemas
@real
def test_twenty_schemas_hold_on_every_dialect_streamed_and_not(openai_client: openai.OpenAI,
                                                               anthropic_client: anthropic.Anthropic) -> None:
    """Each schema's output parses and validates with jsonschema, and ends because the grammar did (not
    max_tokens), on Chat, Responses and Messages, whole and streamed: 120 requests, run concurrently."""
    calls: dict[str, Callable[..., tuple[str, str]]] = {
        "chat": lambda *a: _chat(openai_client, *a), "responses": lambda *a: _responses(openai_client, *a),
        "messages": lambda *a: _messages_api(anthropic_client, *a)}
    jobs = [(dialect, name, stream) for name in SCHEMAS for dialect in calls for stream in (False, True)]

    def run(job: tuple[str, str, bool]) -> str | None:
        dialect, name, stream = job
        ask, schema = SCHEMAS[name]
        text, end = calls[dialect](name, ask, schema, stream)
        if end != DONE[dialect]:
            return f"{job}: ended {end!r}: {text!r}"
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as e:
            return f"{job}: {text!r} does not validate: {str(e)[:200]}"
        return None

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        problems = [p for p in pool.map(run, jobs) if p]
    assert not problems, "\n".join(problems)


@real
def test_json_object_and_the_sdk_parse_helper(openai_client: openai.OpenAI) -> None:
    """json_object gives a JSON object; `chat.completions.parse` with a pydantic model gets it back parsed."""
    r = openai_client.chat.completions.create(model=MODEL, messages=_messages("Give the name of a cat as a JSON object with one key, name."),
                                              temperature=0, max_tokens=MAX_TOKENS,
                                              response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)

    class Pet(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=12)
        legs: int = pydantic.Field(ge=0, le=8)

    parsed = openai_client.chat.completions.parse(model=MODEL, messages=_messages("Describe a pet."), temperature=0,
                                                  max_tokens=MAX_TOKENS, response_format=Pet)
    pet = parsed.choices[0].message.parsed
    assert isinstance(pet, Pet) and 0 <= pet.legs <= 8


# --------------------------------------------------------------------------- regex, grammars, choices
GBNF = 'root ::= answer ", " digit digit\nanswer ::= "yes" | "no"\ndigit ::= [0-9]'
LARK = 'start: ("red" | "green" | "blue") " " NUMBER\nNUMBER: /[1-9][0-9]?/'


@real
def test_regex_gbnf_lark_and_choices_hold(openai_client: openai.OpenAI) -> None:
    """Sampled (temperature 1, n=3), every choice matches: a regex and GBNF on Chat and Completions, Lark
    through response_format, and guided_choice / structured_outputs.choice pick one of the choices."""
    ask = _messages("Answer briefly.")
    cases = [  # (endpoint, extra_body, full-match pattern)
        ("chat", {"guided_regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}, r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
        ("chat", {"response_format": {"type": "regex", "regex": r"(cat|dog)s? [a-z]{1,8}"}}, r"(cat|dog)s? [a-z]{1,8}"),
        ("chat", {"grammar": GBNF}, r"(yes|no), [0-9]{2}"),
        ("chat", {"guided_grammar": LARK}, r"(red|green|blue) [1-9][0-9]?"),
        ("chat", {"response_format": {"type": "grammar", "grammar": GBNF, "syntax": "gbnf"}}, r"(yes|no), [0-9]{2}"),
        ("chat", {"guided_choice": ["alpha", "beta", "gamma"]}, r"alpha|beta|gamma"),
        ("chat", {"structured_outputs": {"choice": ["left", "right"]}}, r"left|right"),
        ("completions", {"guided_regex": r"[A-Z][a-z]{2,6}"}, r"[A-Z][a-z]{2,6}"),
        ("completions", {"grammar": GBNF}, r"(yes|no), [0-9]{2}"),
    ]

    def run(case: tuple[str, dict[str, Any], str]) -> list[str]:
        endpoint, extra, pattern = case
        kw = dict(model=MODEL, temperature=1.0, seed=7, n=3, max_tokens=40, extra_body=extra)
        if endpoint == "chat":
            r = openai_client.chat.completions.create(messages=ask, **kw)
            outs = [(c.message.content, c.finish_reason) for c in r.choices]
        else:
            r = openai_client.completions.create(prompt="The answer is: ", **kw)
            outs = [(c.text, c.finish_reason) for c in r.choices]
        return [f"{extra}: {text!r} ({finish})" for text, finish in outs
                if finish != "stop" or not re.fullmatch(pattern, text)]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        problems = [p for ps in pool.map(run, cases) for p in ps]
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- 400s
BAD_SCHEMA = {"type": "object", "not": {"required": ["x"]}}  # `not` is a keyword llguidance cannot enforce


def _openai_400(call: Callable[[], Any]) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    return e.value.body


@real
@pytest.mark.parametrize("case", ["chat_schema", "chat_regex", "chat_gbnf", "chat_lark", "chat_choice_empty",
                                  "chat_type", "completions_json_schema", "responses_schema", "responses_type"])
def test_a_constraint_that_cannot_compile_is_a_400_naming_the_field(openai_client: openai.OpenAI, case: str) -> None:
    chat = lambda **extra: lambda: openai_client.chat.completions.create(  # noqa: E731
        model=MODEL, messages=_messages("x"), max_tokens=5, extra_body=extra)
    cases = {
        "chat_schema": (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}),
                        "response_format.json_schema.schema"),
        "chat_regex": (chat(guided_regex="a(b"), "guided_regex"),
        "chat_gbnf": (chat(grammar='root ::= "a" missing'), "grammar"),
        "chat_lark": (chat(guided_grammar="start: undefined_rule"), "guided_grammar"),
        "chat_choice_empty": (chat(guided_choice=[]), "guided_choice"),
        "chat_type": (chat(response_format={"type": "xml"}), "response_format.type"),
        "completions_json_schema": (lambda: openai_client.completions.create(
            model=MODEL, prompt="x", max_tokens=5, extra_body={"json_schema": {"$ref": "#/$defs/missing"}}),
            "json_schema"),
        "responses_schema": (lambda: openai_client.responses.create(
            model=MODEL, input="x", text={"format": {"type": "json_schema", "name": "x", "schema": BAD_SCHEMA}}),
            "text.format.schema"),
        "responses_type": (lambda: openai_client.responses.create(
            model=MODEL, input="x", text={"format": {"type": "yaml"}}), "text.format.type"),
    }
    call, param = cases[case]
    body = _openai_400(call)
    assert body["param"] == param and f"'{param}'" in body["message"], body


@real
def test_messages_constraint_400s_name_the_field(anthropic_client: anthropic.Anthropic) -> None:
    for fmt, param in [({"type": "json_schema", "schema": BAD_SCHEMA}, "output_config.format.schema"),
                       ({"type": "json_schema", "schema": {"pattern": "(?=x)", "type": "string"}},
                        "output_config.format.schema"),
                       ({"type": "text"}, "output_config.format.type")]:
        with pytest.raises(anthropic.BadRequestError) as e:
            anthropic_client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}],
                                             output_config={"format": fmt})
        err = e.value.body["error"]
        assert err["type"] == "invalid_request_error" and f"'{param}'" in err["message"], err


@real
def test_limits_and_conflicts_are_400s(openai_client: openai.OpenAI) -> None:
    """The documented limits (size, nesting depth), two constraints at once, and knobs a grammar rules out."""
    big = {"type": "object", "properties": {"k": {"enum": [f"value-{i:06d}" for i in range(6000)]}}}
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(structured.MAX_SCHEMA_DEPTH // 2 + 1):  # two JSON levels a step: past the limit, under the
        deep = {"type": "object", "properties": {"a": deep}}  # request body's own nesting cap (64)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [({"guided_json": big}, "guided_json", "constraint_too_large"),
             ({"guided_regex": "a" * (FieldLimits().constraint_bytes + 1)}, "guided_regex", "constraint_too_large"),
             ({"guided_json": deep}, "guided_json", None),
             ({"guided_json": schema, "guided_regex": "a+"}, "guided_regex", None),
             ({"response_format": {"type": "json_object"}, "grammar": GBNF}, "grammar", None),
             ({"guided_json": schema, "ignore_eos": True}, "ignore_eos", None),
             ({"guided_json": schema, "min_tokens": 4}, "min_tokens", None)]
    for extra, param, code in cases:
        body = _openai_400(lambda: openai_client.chat.completions.create(
            model=MODEL, messages=_messages("x"), max_tokens=5, extra_body=extra))
        assert body["param"] == param, (param, body)
        assert code is None or body["code"] == code, body


# --------------------------------------------------------------------------- ends and logprobs
@real
def test_a_constrained_reply_cut_by_max_tokens_reports_length(openai_client: openai.OpenAI,
                                                              anthropic_client: anthropic.Anthropic) -> None:
    _, schema = SCHEMAS["person"]
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    r = openai_client.chat.completions.create(model=MODEL, messages=_messages("A person."), max_tokens=3,
                                              response_format=fmt)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    r = openai_client.responses.create(model=MODEL, input="A person.", max_output_tokens=3,
                                       text={"format": {"type": "json_schema", "name": "p", "schema": schema}})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    m = anthropic_client.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "A person."}],
                                         output_config={"format": {"type": "json_schema", "schema": schema}})
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


@real
def test_logprobs_of_a_constrained_request_read_zero_for_masked_tokens(openai_client: openai.OpenAI) -> None:
    """Logprobs are of the masked distribution: where the grammar allows only '{', it has probability 1
    (logprob 0) and every alternative is masked, reading MASKED_LOGPROB (JSON cannot carry -inf); under
    greedy decoding the sampled token is always the best allowed one."""
    r = openai_client.chat.completions.create(
        model=MODEL, messages=_messages("Pick a color."), temperature=0, max_tokens=MAX_TOKENS, logprobs=True,
        top_logprobs=5, response_format={"type": "json_schema",
                                         "json_schema": {"name": "c", "schema": SCHEMAS["enum_color"][1]}})
    content = r.choices[0].logprobs.content
    first = content[0]
    assert first.token.startswith("{") and first.logprob == 0.0
    assert [t.logprob for t in first.top_logprobs[1:]] == [MASKED_LOGPROB] * 4
    assert all(e.top_logprobs[0].token == e.token for e in content)
    assert content[-1].token in ("<|im_end|>", "<|endoftext|>")  # an EOS, allowed only once the object is complete
    assert json.loads("".join(e.token for e in content[:-1])) in ({"color": c} for c in ("red", "green", "blue"))


@real
def test_engine_idle_after_with_masks_counted(live_server: LiveServer) -> None:
    """After everything above: the KV pool back at its baseline, mask time counted, nothing compiled."""
    stats = wait_idle(live_server.url)
    assert stats["constrained_rows_total"] >= stats["constrained_steps_total"] > 0
    assert stats["constraint_mask_seconds_total"] > 0
    assert stats["compilations_after_warmup"] == 0
