"""A gpt-oss-style (harmony) model served on loopback, checked with the official openai and anthropic clients:
the analysis channel comes back as reasoning and the final channel as the answer on all three dialects,
whole and streamed, with no header text; `<|end|>` between messages does not end the reply.

The model is scripted_model.ScriptedLM over tiny_models.write_harmony_tokenizer's vocabulary: a random
tiny model cannot be made to write harmony (nor can a token chain: harmony repeats its headers with a
different channel after them), so the reply is a fixed token script chosen by a trigger word in the last
message. Everything from the sampler to the wire runs for real on it.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from support.scripted_model import write_scripted_model
from support.servers import LiveServer, anthropic_for, openai_for, wait_for
from tiny_models import write_harmony_tokenizer

from imp_jax.model.text.tokenizer import Tokenizer

MODEL = "harmonic"
GREEDY = {"temperature": 0}
SUFFIX = "<|end|><|start|>assistant"   # what follows a trigger (the last message's last word) in the prompt
REASON, ANSWER = "Hmm so the user wants weather.", "Yes done, it is sunny."
SCRIPTS = {
    "GO": f"<|channel|>analysis<|message|>{REASON}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}"
          "<|return|>",
    # a call on the commentary channel, its recipient in the channel header
    "CALL": "<|channel|>analysis<|message|>Let me check.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
    # a preamble (commentary, no recipient), then a call with its recipient in the role header
    "TRAIL": "<|channel|>commentary<|message|>I will check.<|end|><|start|>assistant to=functions.get_weather"
             '<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
    # after the tool's result
    "SUNNY": "<|channel|>final<|message|>It is sunny in Paris.<|return|>",
}
HELLO = [{"role": "user", "content": "hello GO"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ARGS = '{"city": "Paris"}'


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / MODEL
    path.mkdir()
    write_harmony_tokenizer(path)
    tok = Tokenizer.from_hf_dir(path)
    scripts = {tok.token_to_id(word): tok.encode(SUFFIX + reply, add_special_tokens=False)
               for word, reply in SCRIPTS.items()}
    write_scripted_model(path, tok.vocab_size, scripts, pad=tok.token_to_id("<|return|>"))
    return path


@pytest.fixture(scope="module")
def harmony_server(harmony_model: Path, tmp_path_factory: pytest.TempPathFactory):
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    live = LiveServer(["--model", str(harmony_model), "--model-class", "support.scripted_model:ScriptedLM",
                       "--max-model-len", "512", "--max-num-seqs", "2", "--max-num-batched-tokens", "32",
                       "--num-kv-blocks", "96"], tmp_path_factory.mktemp("harmony-log") / "server.log",
                      env={"PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")])})
    try:
        wait_for(live.url + "/ready", 200, timeout=600, proc=live.proc)
        yield live
    finally:
        assert live.stop() == 0, live.log_text()[-3000:]


@pytest.fixture(scope="module")
def oai(harmony_server) -> openai.OpenAI:
    return openai_for(harmony_server.url)


@pytest.fixture(scope="module")
def claude(harmony_server) -> anthropic.Anthropic:
    return anthropic_for(harmony_server.url)


@pytest.fixture(scope="module")
def tok(harmony_model: Path) -> Tokenizer:
    return Tokenizer.from_hf_dir(harmony_model)


@pytest.fixture(autouse=True)
def _back_to_baseline(request):
    """After each test, every request has ended and the KV pool is whole again."""
    yield
    if "harmony_server" not in request.fixturenames:
        return
    url = request.getfixturevalue("harmony_server").url
    deadline = time.monotonic() + 30
    while True:
        health = httpx.get(url + "/health").json()
        if health["num_running"] == 0 and health["num_free_blocks"] == health["baseline_free_blocks"]:
            return
        assert time.monotonic() < deadline, health
        time.sleep(0.1)


def _count(tok: Tokenizer, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False))


# ------------------------------------------------------------------------------------------ reasoning
def test_chat_reasoning_content_answer_and_usage(oai, tok, harmony_server):
    r = oai.chat.completions.create(model=MODEL, messages=HELLO, **GREEDY)
    msg, reply = r.choices[0].message, SCRIPTS["GO"]
    assert (msg.reasoning_content, msg.content, r.choices[0].finish_reason) == (REASON, ANSWER, "stop")
    analysis = reply[:reply.index("<|start|>")]   # the analysis message, header to <|end|>
    assert r.usage.completion_tokens == _count(tok, reply)
    assert r.usage.completion_tokens_details.reasoning_tokens == _count(tok, analysis)
    chunks = list(oai.chat.completions.create(model=MODEL, messages=HELLO, stream=True,
                                              stream_options={"include_usage": True}, **GREEDY))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == REASON
    assert "".join(d.content or "" for d in deltas) == ANSWER
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == _count(tok, analysis)
    # a stop string applies to the answer only ("so" is in the reasoning)
    r = oai.chat.completions.create(model=MODEL, messages=HELLO, stop=["so", "sunny"], **GREEDY)
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == (REASON, "Yes done, it is ")


def test_messages_thinking_blocks(claude):
    opt_in = {"type": "enabled", "budget_tokens": 1024}
    m = claude.messages.create(model=MODEL, max_tokens=200, messages=HELLO, thinking=opt_in, extra_body=GREEDY)
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in m.content] == [
        ("thinking", REASON), ("text", ANSWER)]
    assert m.stop_reason == "end_turn"
    with claude.messages.stream(model=MODEL, max_tokens=200, messages=HELLO, thinking=opt_in,
                                extra_body=GREEDY) as stream:
        text = "".join(ev.delta.text for ev in stream if ev.type == "content_block_delta" and ev.delta.type == "text_delta")
        final = stream.get_final_message()
    assert text == ANSWER and final.content[0].thinking == REASON
    plain = claude.messages.create(model=MODEL, max_tokens=200, messages=HELLO, extra_body=GREEDY)
    assert [(b.type, b.text) for b in plain.content] == [("text", ANSWER)]


def test_responses_reasoning_items(oai):
    r = oai.responses.create(model=MODEL, input="hello GO", reasoning={"effort": "high"}, **GREEDY)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert (r.output[0].content[0].text, r.output_text) == (REASON, ANSWER)
    with oai.responses.stream(model=MODEL, input="hello GO", **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == REASON
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER
    assert [o.type for o in final.output] == ["reasoning", "message"]


# ------------------------------------------------------------------------------------------ tool calls
def _no_markup(*texts: str | None) -> bool:
    return not any(t and ("<|" in t or "functions." in t or "assistant" in t) for t in texts)


def test_chat_tool_calls_whole_streamed_and_replayed(oai, tok, harmony_server):
    tools = [{"type": "function", "function": WEATHER}]
    ask = [{"role": "user", "content": "weather CALL"}]
    r = oai.chat.completions.create(model=MODEL, messages=ask, tools=tools, **GREEDY)
    msg = r.choices[0].message
    assert (msg.reasoning_content, msg.content, r.choices[0].finish_reason) == ("Let me check.", None, "tool_calls")
    assert [(c.type, c.function.name, c.function.arguments) for c in msg.tool_calls] == [
        ("function", "get_weather", ARGS)]
    chunks = list(oai.chat.completions.create(model=MODEL, messages=ask, tools=tools, stream=True, **GREEDY))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert calls[0].function.name == "get_weather" and calls[0].id
    assert "".join(tc.function.arguments or "" for tc in calls) == ARGS
    assert _no_markup(*(d.content for d in deltas)) and chunks[-1].choices[0].finish_reason == "tool_calls"
    # a preamble, then the call with its recipient in the role header
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "weather TRAIL"}],
                                    tools=tools, **GREEDY)
    msg = r.choices[0].message
    assert (msg.content, [(c.function.name, c.function.arguments) for c in msg.tool_calls]) == (
        "I will check.", [("get_weather", ARGS)])
    # the call and its result replayed: the prompt is the template's rendering of them, the answer follows
    turn = [*ask, {"role": "assistant", "content": None, "reasoning_content": "Let me check.",
                   "tool_calls": [{"id": "c1", "type": "function",
                                   "function": {"name": "get_weather", "arguments": ARGS}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "SUNNY"}]
    r = oai.chat.completions.create(model=MODEL, messages=turn, tools=tools, reasoning_effort="high", **GREEDY)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("It is sunny in Paris.", "stop")
    want = [{**m, "thinking": m["reasoning_content"]} if m.get("reasoning_content") else m for m in turn]
    want[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    prompt = tok.render_chat(want, tools=tools, reasoning_effort="high")
    assert "Reasoning: high" in prompt and "analysis<|message|>Let me check.<|end|>" in prompt
    assert r.usage.prompt_tokens == len(tok.encode_chat(prompt))
    # no tools offered: a call the model makes anyway stays text (nothing parses it)
    r = oai.chat.completions.create(model=MODEL, messages=ask, **GREEDY)
    assert r.choices[0].message.tool_calls is None and "functions.get_weather" in r.choices[0].message.content


def test_a_forced_tool_choice_is_refused_as_unenforceable(oai, claude):
    """Harmony reads a call's recipient from its headers, outside any grammar: a required or named
    tool_choice cannot be enforced, so it is a 400 tool_choice_unenforceable (imp's code) on every dialect,
    never a reply that ignores it; 'auto' is served."""
    tools = [{"type": "function", "function": WEATHER}]
    ask = [{"role": "user", "content": "weather CALL"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=MODEL, messages=ask, tools=tools, tool_choice=choice, **GREEDY)
        assert (e.value.body["code"], e.value.body["param"]) == ("tool_choice_unenforceable", "tool_choice")
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=50, messages=ask, tool_choice={"type": "any"},
                               tools=[{"name": "get_weather", "input_schema": WEATHER["parameters"]}], extra_body=GREEDY)
    assert "tool_choice" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input="weather CALL", tools=[{"type": "function", **WEATHER}],
                             tool_choice="required", **GREEDY)
    assert e.value.body["code"] == "tool_choice_unenforceable"
    auto = oai.chat.completions.create(model=MODEL, messages=ask, tools=tools, tool_choice="auto", **GREEDY)
    assert auto.choices[0].finish_reason == "tool_calls"


def test_messages_tool_use(claude):
    body = {"model": MODEL, "max_tokens": 200, "extra_body": GREEDY,
            "tools": [{"name": "get_weather", "description": WEATHER["description"],
                       "input_schema": WEATHER["parameters"]}]}
    m = claude.messages.create(**body, messages=[{"role": "user", "content": "weather CALL"}],
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in m.content] == ["thinking", "tool_use"] and m.stop_reason == "tool_use"
    assert (m.content[0].thinking, m.content[1].name, m.content[1].input) == ("Let me check.", "get_weather",
                                                                              {"city": "Paris"})
    with claude.messages.stream(**body, messages=[{"role": "user", "content": "weather TRAIL"}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [ev.content_block.type for ev in events if ev.type == "content_block_start"]
    assert starts == ["text", "tool_use"] and final.stop_reason == "tool_use"
    assert (final.content[0].text, final.content[1].input) == ("I will check.", {"city": "Paris"})
    use = final.content[1]
    after = claude.messages.create(**body, messages=[
        {"role": "user", "content": "weather TRAIL"}, {"role": "assistant", "content": final.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "SUNNY"}]}])
    assert [(b.type, b.text) for b in after.content] == [("text", "It is sunny in Paris.")]


def test_responses_function_calls(oai):
    body = {"model": MODEL, "tools": [{"type": "function", **WEATHER}], **GREEDY}
    r = oai.responses.create(**body, input="weather CALL")
    assert [o.type for o in r.output] == ["reasoning", "function_call"] and r.status == "completed"
    assert (r.output[1].name, r.output[1].arguments) == ("get_weather", ARGS)
    with oai.responses.stream(**body, input="weather TRAIL") as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.item.type for e in events if e.type == "response.output_item.added"] == ["message", "function_call"]
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == ARGS
    assert final.output_text == "I will check." and final.output[1].arguments == ARGS
    call = final.output[1]
    after = oai.responses.create(**body, input=[
        {"role": "user", "content": "weather TRAIL"}, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "SUNNY"}])
    assert after.output_text == "It is sunny in Paris."


# ------------------------------------------------------------------------------------------ the engine itself
@pytest.fixture(scope="module")
def core(harmony_model: Path):
    import jax.numpy as jnp

    from imp_jax.model.formats.loader import load_model
    from imp_jax.runtime.config import EngineConfig
    from imp_jax.runtime.core.engine import EngineCore
    from imp_jax.runtime.parallel.sharding import default_mesh

    loaded = load_model(harmony_model, dtype="float32", model_class="support.scripted_model:ScriptedLM")
    config = EngineConfig(model=str(harmony_model), max_model_len=256, max_num_seqs=2, max_num_batched_tokens=32,
                          block_size=16, num_kv_blocks=40)
    shape = loaded.model.kv_cache_shape(40, 16)
    engine = EngineCore(loaded, config, (jnp.zeros(shape), jnp.zeros(shape)), 40, default_mesh())
    engine.step_fn.warm_up()
    return engine


def _events(core, tok: Tokenizer, words: str, **request) -> list:
    """The events of a greedy chat reply to `words` on the engine core."""
    import uuid

    from imp_jax.runtime.request import GenerationRequest, SamplingParams

    prompt = tok.encode_chat(tok.render_chat([{"role": "user", "content": words}]))
    events = []
    core.add_request(GenerationRequest(uuid.uuid4().hex, prompt, SamplingParams(temperature=0.0, max_tokens=120),
                                       reasoning=True, **request), events.append)
    while core.has_work():
        core.step()
    assert core.pool.num_free_blocks == core.baseline_free_blocks
    return events


def _generate(core, tok: Tokenizer, words: str, **request) -> tuple[str, str, list[int], object]:
    """(reasoning, answer, token ids, last event) of a greedy chat reply to `words` on the engine core."""
    events = _events(core, tok, words, **request)
    return ("".join(e.reasoning_text for e in events), "".join(e.text for e in events),
            [t for e in events for t in e.token_ids], events[-1])


def test_a_grammar_constrains_the_final_message_only(core, tok):
    """The matcher sees the final channel's content alone: the analysis (which the regex would refuse) and
    the headers are free."""
    import llguidance

    reasoning, answer, _, last = _generate(core, tok, "hello GO", constraint=llguidance.LLMatcher.grammar_from_regex(
        r"Yes done, it is sunny\."))
    assert (reasoning, answer, last.finish_reason) == (REASON, ANSWER, "stop")
    # a grammar the script breaks: the final message follows the grammar, not the script
    _, answer, _, _ = _generate(core, tok, "hello GO", constraint=llguidance.LLMatcher.grammar_from_regex(
        r"Yes done\."))
    assert answer == "Yes done."


def test_a_reasoning_budget_forces_the_final_header(core, tok):
    """After `budget` reasoning tokens the engine writes `<|end|><|start|>assistant<|channel|>final<|message|>`
    through the allowed-token mask; what the model writes next is the answer."""
    header = tok.encode("<|channel|>analysis<|message|>", add_special_tokens=False)
    content = tok.encode(REASON, add_special_tokens=False)
    reasoning, answer, ids, last = _generate(core, tok, "hello GO", reasoning_budget=len(header) + 2)
    forced = tok.encode("<|end|><|start|>assistant<|channel|>final<|message|>", add_special_tokens=False)
    assert reasoning == tok.decode(content[:2])
    assert ids[:len(header) + 2 + len(forced)] == header + content[:2] + forced
    assert answer.endswith(ANSWER) and "<|" not in answer and last.finish_reason == "stop"
    assert last.usage.reasoning_tokens == len(header) + 2 + 1   # the forced <|end|> closes the analysis


def test_with_tools_offered_a_call_leaves_the_engine_as_values(core, tok):
    """GenerationRequest.tool_calls: the call comes in the events' `answer` as values (its name when its header is
    read, its arguments as they are sampled, its end), beside the preamble's text, and no event's text holds
    markup; without tools offered the call stays answer text, as generated."""
    from imp_jax.runtime.replies.calls import ArgsDelta, CallEnd, CallStart, TextDelta, collect_reply

    events = _events(core, tok, "weather TRAIL", tool_calls=True)
    assert all(e.answer is not None for e in events) and _no_markup(*(e.text for e in events))
    parts = [p for e in events for p in e.answer]
    reply = collect_reply(parts)
    assert (reply.content, [(c.name, c.arguments) for c in reply.calls]) == ("I will check.", [("get_weather", ARGS)])
    assert "".join(e.text for e in events) == "".join(p.text for p in parts if isinstance(p, TextDelta))
    kinds = [type(p) for p in parts]
    assert kinds.index(CallStart) < kinds.index(ArgsDelta) and kinds[-1] is CallEnd and parts[-1].valid
    assert sum(any(isinstance(p, ArgsDelta) for p in e.answer) for e in events) > 1   # streamed, not whole
    plain = _events(core, tok, "weather TRAIL")
    assert all(e.answer is None for e in plain) and "to=functions.get_weather" in "".join(e.text for e in plain)
