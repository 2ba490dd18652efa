"""gpt-oss's harmony replies: the engine's tracker (runtime/replies/harmony.py) splits the analysis channel into
reasoning and the final channel into the answer, token by token, with headers never in the text; a
message to `functions.NAME` becomes call markup the harmony tool parser reads; malformed headers are text.

The vocabulary is tiny_models.write_harmony_tokenizer's (the harmony special tokens, channel names split
across ordinary tokens); replies are written as text and tokenized, so each check is against what the
reply says, independently of how the tracker reads it.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import write_harmony_tokenizer

from imp_jax.model.text.tokenizer import Tokenizer
from imp_jax.runtime.replies.harmony import (
    MAX_HEADER_TOKENS,
    HarmonyMarkers,
    HarmonyTracker,
    Header,
    reply_markers,
)
from imp_jax.runtime.replies.reasoning import ANSWER, MARKER, THINK, ThinkMarkers

PROMPT = "<|start|>system<|message|>Reasoning: medium<|end|><|start|>user<|message|>GO<|end|><|start|>assistant"
REPLY = ("<|channel|>analysis<|message|>Hmm so the user wants weather.<|end|>"
         "<|start|>assistant<|channel|>final<|message|>Yes done, it is sunny.<|return|>")


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path: Path = tmp_path_factory.mktemp("harmony-tokenizer")
    write_harmony_tokenizer(path)
    return Tokenizer.from_hf_dir(path)


@pytest.fixture(scope="module")
def markers(tok: Tokenizer) -> HarmonyMarkers:
    m = HarmonyMarkers.from_tokenizer(tok)
    assert m is not None
    return m


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def run(tok: Tokenizer, tracker: HarmonyTracker, reply: list[int]) -> tuple[str, str, list[str]]:
    """What the engine makes of `reply`: (reasoning text, answer text, each token's kind). A reply's EOS
    (<|return|>, <|call|>) ends it as the engine does: no text of its own, then the text still owed."""
    reasoning, answer, kinds = "", "", []
    for t in reply:
        kind = tracker.observe(t)
        kinds.append(kind)
        if t in tok.eos_ids:
            break
        text = tok.decode([t])
        if kind == THINK:
            reasoning += text
        elif kind == ANSWER:
            answer += tracker.answer_text(text)
    return reasoning, answer + tracker.finish_text(), kinds


# ------------------------------------------------------------------------------------------ detection
def test_markers_are_found_by_special_token_and_eos_is_return_and_call(tok, markers):
    assert tok.decode(list(markers.final_ids), skip_special_tokens=False) == \
        "<|end|><|start|>assistant<|channel|>final<|message|>"
    assert {tok.token_to_id(t) for t in ("<|return|>", "<|call|>")} <= tok.eos_ids
    assert tok.token_to_id("<|end|>") not in tok.eos_ids
    assert ThinkMarkers.from_tokenizer(tok) is None   # no <think> in this vocabulary


def test_the_engine_states_whether_the_model_thinks(tok):
    """reply_markers, the engines' model fact: harmony's markers where the vocabulary speaks it, else a <think>
    block's, else none (Engine.thinks False); an engine without its own (the tests' fake) reads its tokenizer."""
    from support.servers import FakeEngine, fake_tokenizer

    assert isinstance(reply_markers(tok), HarmonyMarkers) and FakeEngine(tok).thinks
    chatml = fake_tokenizer()
    assert reply_markers(chatml) is None and not FakeEngine(chatml).thinks


def test_a_harmony_vocabulary_ends_at_return_and_call_whatever_its_configs_say(tmp_path):
    import json

    write_harmony_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|end|>"}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.eos_ids == {tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")}


def test_a_vocabulary_without_harmony_tokens_is_not_harmony(tmp_path):
    from tiny_models import write_thinking_model

    write_thinking_model(tmp_path)
    assert HarmonyMarkers.from_tokenizer(Tokenizer.from_hf_dir(tmp_path)) is None


def test_headers_are_read_in_both_recipient_placements():
    h = Header.parse("assistant<|channel|>commentary to=functions.get_weather <|constrain|>json")
    assert (h.channel, h.recipient, h.kind) == ("commentary", "functions.get_weather", ANSWER)
    h = Header.parse("assistant to=functions.get_weather<|channel|>commentary json")
    assert (h.channel, h.recipient) == ("commentary", "functions.get_weather")
    assert (Header.parse("assistant<|channel|>analysis").kind, Header.parse("assistant").channel) == (THINK, "")


# ------------------------------------------------------------------------------------------ the split
def test_analysis_is_reasoning_and_final_is_the_answer(tok, markers):
    t = markers.tracker(ids(tok, PROMPT))
    reasoning, answer, kinds = run(tok, t, ids(tok, REPLY))
    assert (reasoning, answer) == ("Hmm so the user wants weather.", "Yes done, it is sunny.")
    # reasoning tokens: the analysis header's sampled tokens, its content and its <|end|>
    analysis = ids(tok, "<|channel|>analysis<|message|>Hmm so the user wants weather.<|end|>")
    assert t.num_reasoning_tokens == len(analysis) == kinds.count(THINK) + kinds[:len(analysis)].count(MARKER)
    assert not t.thinking and t.force_end() == "already_closed"


def test_every_message_kind_in_one_reply(tok, markers):
    """Two analysis messages, a preamble (commentary, no recipient: answer text), then the final answer;
    <|end|> ends a message, never the reply."""
    reply = ("<|channel|>analysis<|message|>Hmm<|end|><|start|>assistant<|channel|>commentary<|message|>Let me "
             "check.<|end|><|start|>assistant<|channel|>analysis<|message|> so<|end|>"
             "<|start|>assistant<|channel|>final<|message|>Yes done<|return|>")
    reasoning, answer, _ = run(tok, markers.tracker(ids(tok, PROMPT)), ids(tok, reply))
    assert (reasoning, answer) == ("Hmm so", "Let me check.Yes done")


def test_a_call_becomes_markup_for_the_tool_parser(tok, markers):
    for header in ("<|channel|>commentary to=functions.get_weather <|constrain|>json",
                   " to=functions.get_weather<|channel|>commentary json"):
        reply = (f"<|channel|>analysis<|message|>Hmm<|end|><|start|>assistant{header}<|message|>"
                 '{"city": "Paris"}<|call|>')
        reasoning, answer, _ = run(tok, markers.tracker(ids(tok, PROMPT)), ids(tok, reply))
        assert reasoning == "Hmm"
        assert answer == f'<|start|>assistant{header}<|message|>{{"city": "Paris"}}'


def test_a_call_followed_by_another_message_is_closed(tok, markers):
    reply = ('<|channel|>commentary to=functions.get_weather<|message|>{"city": "Paris"}<|end|>'
             "<|start|>assistant<|channel|>final<|message|>Yes<|return|>")
    _, answer, _ = run(tok, markers.tracker(ids(tok, PROMPT)), ids(tok, reply))
    assert answer == '<|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>{"city": "Paris"}' \
                     "<|end|>Yes"


def test_a_prompt_that_opens_the_analysis_continues_it(tok, markers):
    t = markers.tracker(ids(tok, PROMPT + "<|channel|>analysis<|message|>Hmm"))
    assert t.thinking
    reasoning, answer, _ = run(tok, t, ids(tok, " so<|end|><|start|>assistant<|channel|>final<|message|>Yes<|return|>"))
    assert (reasoning, answer) == (" so", "Yes")
    assert markers.tracker(ids(tok, "Hello")).constrained is False   # no header anywhere: text is answer
    assert run(tok, markers.tracker(ids(tok, "Hello")), ids(tok, " there"))[1] == " there"


# ------------------------------------------------------------------------------------------ malformed
@pytest.mark.parametrize("reply, answer", [
    ("<|channel|>final", "final"),                                     # cut off inside the header
    ("<|channel|>final<|end|>Yes", "finalYes"),                        # a header ended without <|message|>
    ("<|channel|>fi<|start|>assistant<|channel|>final<|message|>Yes", "fiYes"),   # a header restarted
    ("<|message|>Yes", "Yes"),                                         # no channel at all: answer text
    ("Yes<|end|> done", "Yes done"),                                   # text between messages
])
def test_malformed_headers_are_text(tok, markers, reply, answer):
    assert run(tok, markers.tracker(ids(tok, PROMPT)), ids(tok, reply))[:2] == ("", answer)


def test_a_runaway_header_turns_into_text(tok, markers):
    words = " Hmm" * (MAX_HEADER_TOKENS + 5)
    reasoning, answer, kinds = run(tok, markers.tracker(ids(tok, PROMPT)), ids(tok, "<|channel|>" + words))
    assert reasoning == "" and answer == words and kinds[MAX_HEADER_TOKENS + 1] == ANSWER


# ------------------------------------------------------------------------------------------ forced end
def test_end_thinking_and_a_budget_force_the_final_header(tok, markers):
    t = markers.tracker(ids(tok, PROMPT))
    assert [t.observe(i) for i in ids(tok, "<|channel|>analysis<|message|>Hmm")][-1] == THINK
    assert t.force_end() == "ending" and t.force_end() == "already_closed"
    forced = []
    while t.forced_token is not None:
        forced.append(t.forced_token)
        t.observe(forced[-1])
    assert forced == list(markers.final_ids) and t.constrained and not t.thinking
    early = markers.tracker(ids(tok, PROMPT))   # before the analysis opened: ended as soon as it does
    assert early.force_end() == "ending" and early.forced_token is None
    [early.observe(i) for i in ids(tok, "<|channel|>analysis<|message|>")]
    assert early.forced_token == markers.end_id
    capped = markers.tracker(ids(tok, PROMPT), budget=5)
    kinds = [capped.observe(i) for i in ids(tok, "<|channel|>analysis<|message|>Hmm")]
    assert (capped.num_reasoning_tokens, capped.forced_token) == (5, markers.end_id), kinds
    final = markers.tracker(ids(tok, PROMPT))
    [final.observe(i) for i in ids(tok, "<|channel|>final<|message|>Yes")]
    assert final.force_end() == "already_closed" and final.constrained


# ------------------------------------------------------------------------------------------ GGUF ends
class _Meta:
    """GGUF tokenizer metadata (gguf_tokenizer.Metadata) built from a tokenizer.json."""

    def __init__(self, values: dict):
        self.path, self.values = Path("harmony.gguf"), values

    def get(self, key: str, default=None):
        return self.values.get(key, default)

    def need(self, key: str):
        return self.values[key]


def _gguf_meta(tok_dir: Path, rename: dict[str, str] | None = None) -> _Meta:
    import json

    spec = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    specials = {t["content"] for t in spec["added_tokens"] if t["special"]}
    types = [3 if t in specials else 1 for t in tokens]
    tokens = [(rename or {}).get(t, t) for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return _Meta({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                  "tokenizer.ggml.merges": merges, "tokenizer.ggml.eos_token_id": vocab["<|return|>"],
                  "tokenizer.ggml.eot_token_id": vocab["<|end|>"]})


def test_a_gguf_harmony_vocabulary_ends_at_return_and_call_not_end(tmp_path):
    """As llama.cpp: where <|return|> and <|call|> exist, <|end|> (even named the eot token) ends no reply."""
    from imp_jax.model.text.gguf_tokenizer import gguf_tokenizer

    write_harmony_tokenizer(tmp_path)
    tok, gen = gguf_tokenizer(_gguf_meta(tmp_path))
    want = {tok.token_to_id(t) for t in ("<|return|>", "<|call|>", "<|endoftext|>")}
    assert tok.eos_ids == want and set(gen["eos_token_id"]) == want
    assert HarmonyMarkers.from_tokenizer(tok) is not None
    phi, _ = gguf_tokenizer(_gguf_meta(tmp_path, rename={"<|call|>": "<|calm|>"}))   # no <|call|>: not harmony
    assert phi.token_to_id("<|end|>") in phi.eos_ids


# ------------------------------------------------------------------------------------------ the call parser
CALL_TEXT = ('I will check.<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
             '<|message|>{"city": "Paris", "days": [1, 2]}<|end|>Done.')


def test_the_parser_reads_a_call_split_anywhere():
    from imp_jax.runtime.replies.calls import ArgsDelta, CallStart, collect_reply
    from imp_jax.runtime.replies.tool_calls import HarmonyParser, parse_reply

    whole = parse_reply(CALL_TEXT, "harmony")
    assert whole.content == "I will check.Done."
    assert [(c.name, c.arguments) for c in whole.calls] == [("get_weather", '{"city": "Paris", "days": [1, 2]}')]
    for i in range(len(CALL_TEXT) + 1):
        for j in range(i, len(CALL_TEXT) + 1, 7):
            p = HarmonyParser()
            events = p.feed(CALL_TEXT[:i]) + p.feed(CALL_TEXT[i:j]) + p.feed(CALL_TEXT[j:]) + p.finish()
            got = collect_reply(events)
            assert (got.content, [(c.name, c.arguments) for c in got.calls]) == \
                (whole.content, [(c.name, c.arguments) for c in whole.calls]), (i, j)
            assert "".join(e.text for e in events if isinstance(e, ArgsDelta)) == whole.calls[0].arguments
            assert sum(isinstance(e, CallStart) for e in events) == 1


@pytest.mark.parametrize("text", [
    "<|start|>assistant to=python<|channel|>commentary<|message|>print(1)<|end|>x",   # not a function: text
    "<|start|>assistant to=functions.f<|channel|>commentary<|message|>oops<|end|>x",  # arguments no JSON
    '<|start|>assistant to=functions.f<|channel|>commentary<|message|>{"a": ',          # cut off arguments
    "ab<|start|>assistant to=functions.f<|chan",                                       # cut off header
])
def test_the_parser_keeps_what_is_no_call_as_text(text):
    from imp_jax.runtime.replies.tool_calls import parse_reply

    assert parse_reply(text, "harmony").content == text and not parse_reply(text, "harmony").calls


def test_a_tracked_call_reply_parses_into_reasoning_preamble_and_call(tok, markers):
    from imp_jax.runtime.replies.tool_calls import parse_reply

    reply = ("<|channel|>analysis<|message|>Hmm<|end|><|start|>assistant<|channel|>commentary<|message|>I will "
             "check.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
             '{"city": "Paris"}<|call|>')
    reasoning, answer, _ = run(tok, markers.tracker(ids(tok, PROMPT)), ids(tok, reply))
    parsed = parse_reply(answer, "harmony")
    assert (reasoning, parsed.content) == ("Hmm", "I will check.")
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", '{"city": "Paris"}')]


# ------------------------------------------------------------------------------------------ the prompt
# a replayed call turn: reasoning, a call (with content beside it) and its result
WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
REPLAYED = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "I will check.", "reasoning_content": "Hmm",
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "SUNNY"}]


def test_the_prompt_replays_reasoning_calls_and_results(tok):
    """The harmony template gets replayed reasoning as `thinking` (a call turn's content gives way), call
    arguments as an object, the result after its call, and reasoning_effort."""
    from imp_jax.server.reasoning import template_kwargs
    from imp_jax.server.tools import chat_plan, render_prompt, tokenizer_tools

    assert tokenizer_tools(tok).fmt == "harmony" and tokenizer_tools(tok).native
    text = render_prompt(tok, REPLAYED, chat_plan(WEATHER_TOOLS, None, None), **template_kwargs(None, None, "high"))
    assert text == ("<|start|>system<|message|>Reasoning: high<|end|><|start|>developer<|message|># Tools get_weather"
                    "<|end|><|start|>user<|message|>weather?<|end|><|start|>assistant<|channel|>analysis<|message|>Hmm"
                    "<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
                    '<|message|>{"city": "Paris"}<|call|><|start|>functions.get_weather to=assistant<|channel|>'
                    "commentary<|message|>SUNNY<|end|><|start|>assistant")


OFFICIAL_TEMPLATE = (Path.home() / ".cache/imp_jax/peers/src/llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates"
                     / "openai-gpt-oss-120b.jinja")


@pytest.mark.skipif(not OFFICIAL_TEMPLATE.is_file(), reason="llama.cpp's copy of the gpt-oss template is not here")
def test_the_official_gpt_oss_template_takes_the_replayed_turns(tmp_path):
    """OpenAI's template (as llama.cpp ships it) refuses content beside thinking in a call turn; the server's
    messages render, with the reasoning, the call, its result and the effort where harmony puts them."""
    import json

    from imp_jax.server.tools import chat_plan, render_prompt

    write_harmony_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = OFFICIAL_TEMPLATE.read_text()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    official = Tokenizer.from_hf_dir(tmp_path)
    text = render_prompt(official, REPLAYED, chat_plan(WEATHER_TOOLS, None, None), reasoning_effort="low")
    assert "Reasoning: low" in text and "namespace functions" in text and text.endswith("<|start|>assistant")
    assert "<|start|>assistant<|channel|>analysis<|message|>Hmm<|end|>" in text
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
            "<|call|>") in text
    # (this template prints a result with tojson)
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"SUNNY"<|end|>' in text
