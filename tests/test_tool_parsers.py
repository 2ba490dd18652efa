"""The tool-call parsers (runtime/replies/tool_calls.py): each format whole and fed one character at a time,
text around calls, malformed and unfinished calls, and the streamed events' shape."""
from __future__ import annotations

import json

import pytest

from imp_jax.runtime.replies.calls import ArgsDelta, CallEnd, CallStart, ParseEvent, TextDelta, collect_reply
from imp_jax.runtime.replies.tool_calls import PARSERS, parse_reply


def streamed(text: str, fmt: str) -> list[ParseEvent]:
    parser = PARSERS[fmt]()
    events = [e for ch in text for e in parser.feed(ch)]
    return events + parser.finish()


def parsed(text: str, fmt: str) -> tuple[str, list[tuple[str, dict]]]:
    """(content, [(name, arguments)]) of the whole-text parse, checked equal to the one-character stream's."""
    whole = parse_reply(text, fmt)
    inc = collect_reply(streamed(text, fmt))
    flat = lambda r: (r.content, [(c.name, json.loads(c.arguments)) for c in r.calls])  # noqa: E731
    assert flat(whole) == flat(inc)
    assert len({c.id for c in whole.calls}) == len(whole.calls)
    assert all(c.id.startswith("call_") for c in whole.calls)
    return flat(whole)


HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>'

CASES: dict[str, tuple[str, str, str, list[tuple[str, dict]]]] = {
    # name: (format, text, content, calls)
    "hermes_one": ("hermes", HERMES, "", [("get_weather", {"city": "Paris", "days": [1, 2]})]),
    "hermes_text_around": ("hermes", f"Let me check.\n{HERMES}\nDone.", "Let me check.\nDone.",
                           [("get_weather", {"city": "Paris", "days": [1, 2]})]),
    "hermes_parallel": ("hermes", HERMES + "\n" + '<tool_call>{"name": "t", "arguments": {}}</tool_call>', "",
                        [("get_weather", {"city": "Paris", "days": [1, 2]}), ("t", {})]),
    "hermes_keys_reordered": ("hermes", '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', "",
                              [("f", {"a": 1})]),
    "hermes_braces_in_strings": ("hermes", '<tool_call>{"name": "f", "arguments": {"s": "}{\\"]["}}</tool_call>',
                                 "", [("f", {"s": '}{"]['})]),
    "hermes_no_closing_tag": ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}}', "", [("f", {"a": 1})]),
    "hermes_cut_in_closing_tag": ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}}\n</too', "",
                                  [("f", {"a": 1})]),
    "hermes_plain_text": ("hermes", "No tools needed: 2 < 3 and <b>bold</b>.",
                          "No tools needed: 2 < 3 and <b>bold</b>.", []),
    "hermes_partial_tag_is_text": ("hermes", "a <tool_ca", "a <tool_ca", []),
    "hermes_not_json": ("hermes", "a <tool_call>not json</tool_call> b", "a <tool_call>not json</tool_call> b", []),
    "hermes_bad_json": ("hermes", '<tool_call>{"name": "f", "arguments": {a: 1}}</tool_call>',
                        '<tool_call>{"name": "f", "arguments": {a: 1}}</tool_call>', []),
    "hermes_unfinished": ("hermes", 'x <tool_call>{"name": "f", "arguments": {"a": ',
                          'x<tool_call>{"name": "f", "arguments": {"a": ', []),
    "hermes_arguments_not_object": ("hermes", '<tool_call>{"name": "f", "arguments": 5}</tool_call>',
                                    '<tool_call>{"name": "f", "arguments": 5}</tool_call>', []),
    "llama3_one": ("llama3_json", '{"name": "f", "parameters": {"a": 1}}', "", [("f", {"a": 1})]),
    "llama3_python_tag_and_two": ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; '
                                  '{"name": "g", "parameters": {}}', "", [("f", {"a": 1}), ("g", {})]),
    "llama3_text": ("llama3_json", 'The answer is {"name": "f"}', 'The answer is {"name": "f"}', []),
    "llama3_json_not_a_call": ("llama3_json", '{"a": 1}', '{"a": 1}', []),
    "llama3_unfinished": ("llama3_json", '{"name": "f", "parameters": {"a"', '{"name": "f", "parameters": {"a"', []),
    "mistral_array": ("mistral", 'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, '
                      '{"name": "g", "arguments": {}}]', "Sure.", [("f", {"a": 1}), ("g", {})]),
    "mistral_v11": ("mistral", '[TOOL_CALLS]f[ARGS]{"a": {"b": [1]}}[TOOL_CALLS]g[ARGS]{}', "",
                    [("f", {"a": {"b": [1]}}), ("g", {})]),
    "mistral_text": ("mistral", "[not a call] TOOL_CALLS", "[not a call] TOOL_CALLS", []),
}


@pytest.mark.parametrize("name", list(CASES))
def test_parse_whole_and_one_character_at_a_time(name: str) -> None:
    fmt, text, content, calls = CASES[name]
    assert parsed(text, fmt) == (content, calls)


def test_stream_announces_the_name_first_then_argument_fragments() -> None:
    parser = PARSERS["hermes"]()
    events: list[tuple[str, ParseEvent]] = []
    for ch in "Hi " + HERMES:
        events += [(ch, e) for e in parser.feed(ch)]
    events += [("", e) for e in parser.finish()]
    kinds = [type(e).__name__ for _, e in events]
    first = kinds.index("CallStart")
    assert set(kinds[:first]) == {"TextDelta"} and kinds[-1] == "CallEnd"
    assert set(kinds[first + 1:-1]) == {"ArgsDelta"} and len(kinds[first + 1:-1]) > 10  # streamed, not one lump
    start = events[first][1]
    assert isinstance(start, CallStart) and start.name == "get_weather" and start.index == 0
    assert events[first][0] == ":"  # announced on the colon after "name": "get_weather", "arguments"
    args = "".join(e.text for _, e in events if isinstance(e, ArgsDelta))
    end = events[-1][1]
    assert isinstance(end, CallEnd) and end.valid and end.arguments == args
    assert json.loads(args) == {"city": "Paris", "days": [1, 2]}
    assert "".join(e.text for _, e in events if isinstance(e, TextDelta)) == "Hi"  # the space before the call dropped
    assert end.markup.startswith("<tool_call>") and end.markup.rstrip().endswith("</tool_call>")


def test_text_is_not_held_back_longer_than_a_possible_tag() -> None:
    parser = PARSERS["hermes"]()
    assert parser.feed("Hello world") == [TextDelta("Hello world")]
    assert parser.feed(" <tool") == []                   # could be a tag: held
    assert parser.feed("box>") == [TextDelta(" <toolbox>")]  # was not
    assert parser.finish() == []


def test_markup_never_leaks_into_streamed_text() -> None:
    text = "Checking. " + HERMES + "\n" + HERMES
    for fmt_text, fmt in ((text, "hermes"), ('[TOOL_CALLS][{"name": "f", "arguments": {}}]', "mistral")):
        streamed_text = "".join(e.text for e in streamed(fmt_text, fmt) if isinstance(e, TextDelta))
        assert "tool_call" not in streamed_text.lower() and "{" not in streamed_text
