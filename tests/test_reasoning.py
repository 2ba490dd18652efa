"""Reasoning: a thinking model's <think> block is split from its answer on all three dialects, stop
strings and grammars apply to the answer only, usage counts reasoning tokens, an open <think> in the
prompt continues as reasoning, and POST /v1/requests/{id}/end_thinking ends a block mid-flight.

The model (tiny_models.write_thinking_model) is deterministic by construction: under greedy decoding
it thinks "Hmm so" and answers "Yes done", "ok" thinks forever and "zz" answers forever.
"""
from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from imp_jax.runtime.replies.reasoning import ANSWER, MARKER, THINK, ThinkMarkers, ThinkTracker, answer_reserve
from support.servers import LiveServer, anthropic_for, openai_for, wait_for
from tiny_models import THINKER_ARGS, write_thinking_model

MODEL = "thinker"   # the served name: the model directory's
GREEDY = {"temperature": 0}
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    path = tmp_path_factory.mktemp("models") / MODEL
    path.mkdir()
    return path, write_thinking_model(path)


@pytest.fixture(scope="module")
def thinking_server(thinking_model, tmp_path_factory: pytest.TempPathFactory):
    path, _ = thinking_model
    live = LiveServer(["--model", str(path), *THINKER_ARGS],
                      tmp_path_factory.mktemp("thinker-log") / "server.log")
    try:
        wait_for(live.url + "/ready", 200, timeout=600, proc=live.proc)
        yield live
    finally:
        live.stop()


@pytest.fixture(scope="module")
def oai(thinking_server) -> openai.OpenAI:
    return openai_for(thinking_server.url)


@pytest.fixture(scope="module")
def claude(thinking_server) -> anthropic.Anthropic:
    return anthropic_for(thinking_server.url)


# ------------------------------------------------------------------------------------------ the tracker
def test_the_tracker_splits_by_token_id_and_forces_the_end(thinking_model):
    _, ids = thinking_model
    markers = ThinkMarkers(ids["<think>"], ids["</think>"], (ids["</think>"], ids["\n\n"]))
    t = ThinkTracker(markers, [ids["\n"]])
    assert [t.observe(ids[p]) for p in ("<think>", "Hmm", "</think>", "Yes")] == [MARKER, THINK, MARKER, ANSWER]
    assert t.num_reasoning_tokens == 3 and t.answer_text("\n\nYes") == "Yes" and t.force_end() == "already_closed"
    early = ThinkTracker(markers, [ids["\n"]])   # end_thinking before the model opened its block
    assert early.force_end() == "ending" and early.forced_token is None
    assert early.observe(ids["<think>"]) == MARKER and early.forced_token == ids["</think>"]
    assert [early.observe(ids["</think>"]), early.observe(ids["\n\n"])] == [MARKER, MARKER]
    assert early.constrained and not early.thinking
    capped = ThinkTracker(markers, [ids["<think>"], ids["ok"]], budget=2)   # the prompt opened the block
    assert capped.thinking and [capped.observe(ids["ok"]) for _ in range(2)] == [THINK, THINK]
    assert capped.forced_token == ids["</think>"] and not capped.constrained
    assert not ThinkTracker(markers, [ids["<think>"], ids["</think>"], ids["zz"]]).thinking


# ------------------------------------------------------------------------------------------ Chat
def test_chat_reasoning_content_usage_and_stop_strings(oai):
    r = oai.chat.completions.create(model=MODEL, messages=HELLO, **GREEDY)
    msg = r.choices[0].message
    assert (msg.reasoning_content, msg.content, r.choices[0].finish_reason) == ("Hmm so", "Yes done", "stop")
    # <think> Hmm so </think> are reasoning; \n\n Yes done <|im_end|> the answer
    assert (r.usage.completion_tokens, r.usage.completion_tokens_details.reasoning_tokens) == (8, 4)
    # a stop string matches the answer only: "o" is in the reasoning too
    r = oai.chat.completions.create(model=MODEL, messages=HELLO, stop=["o"], **GREEDY)
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == ("Hmm so", "Yes d")
    assert r.choices[0].finish_reason == "stop"
    chunks = list(oai.chat.completions.create(model=MODEL, messages=HELLO, stream=True,
                                              stream_options={"include_usage": True}, **GREEDY))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Hmm so"
    assert "".join(d.content or "" for d in deltas) == "Yes done"
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 4


def test_chat_template_switches_and_an_open_think_prefill(oai):
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        r = oai.chat.completions.create(model=MODEL, messages=HELLO, extra_body=extra, **GREEDY)
        assert getattr(r.choices[0].message, "reasoning_content", None) is None, extra
        assert r.choices[0].message.content == "Yes done" and r.usage.completion_tokens_details.reasoning_tokens == 0
    # the prefix leaves <think> open: the reply's new text continues the reasoning
    prefill = HELLO + [{"role": "assistant", "content": "<think>Hmm"}]
    r = oai.chat.completions.create(model=MODEL, messages=prefill, extra_body={
        "continue_final_message": True, "add_generation_prompt": False}, **GREEDY)
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == (" so", "Yes done")
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=HELLO, reasoning_effort="lots", **GREEDY)
    assert e.value.body["param"] == "reasoning_effort"


# ------------------------------------------------------------------------------------------ Messages
def test_messages_thinking_blocks_on_opt_in(claude):
    opt_in = {"type": "enabled", "budget_tokens": 1024}
    m = claude.messages.create(model=MODEL, max_tokens=50, messages=HELLO, thinking=opt_in, extra_body=GREEDY)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert (m.content[0].thinking, m.content[1].text) == ("Hmm so", "Yes done") and m.content[0].signature
    with claude.messages.stream(model=MODEL, max_tokens=50, messages=HELLO, thinking=opt_in,
                                extra_body=GREEDY) as stream:
        kinds = [ev.delta.type for ev in stream if ev.type == "content_block_delta"]
        final = stream.get_final_message()
    assert kinds == ["thinking_delta", "thinking_delta", "signature_delta", "text_delta", "text_delta"]
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
        ("thinking", "Hmm so"), ("text", "Yes done")]
    assert final.content[0].signature == m.content[0].signature
    # no opt-in: the template is told not to think, and no thinking block comes back
    plain = claude.messages.create(model=MODEL, max_tokens=50, messages=HELLO, extra_body=GREEDY)
    assert [(b.type, b.text) for b in plain.content] == [("text", "Yes done")]
    # budget_tokens caps the block: "ok" would think forever; replayed thinking blocks are accepted
    looping = [*HELLO, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "earlier", "signature": "x"}, {"type": "text", "text": "<think>ok"}]}]
    capped = claude.messages.create(model=MODEL, max_tokens=50, messages=looping, extra_body=GREEDY,
                                    thinking={"type": "enabled", "budget_tokens": 5})
    assert (capped.content[0].thinking, capped.content[1].text) == ("ok" * 5, "Yes done")
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=50, messages=HELLO, thinking={"type": "sometimes"})
    assert "thinking.type" in e.value.message


# ------------------------------------------------------------------------------------------ Responses
def test_responses_reasoning_items(oai):
    r = oai.responses.create(model=MODEL, input="hello", reasoning={"effort": "high"}, **GREEDY)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert (r.output[0].content[0].text, r.output_text) == ("Hmm so", "Yes done")
    assert r.usage.output_tokens_details.reasoning_tokens == 4
    with oai.responses.stream(model=MODEL, input="hello", **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Hmm so"
    assert [(e.type, e.output_index) for e in events if e.type.startswith("response.output_item")] == [
        ("response.output_item.added", 0), ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.output_item.done", 1)]
    assert [o.type for o in final.output] == ["reasoning", "message"] and final.output_text == "Yes done"
    replay = oai.responses.create(model=MODEL, input=[
        {"role": "user", "content": "hello"}, r.output[0].model_dump(exclude_none=True),
        {"role": "assistant", "content": "Yes done"}, {"role": "user", "content": "again"}], **GREEDY)
    assert replay.output_text == "Yes done"


def test_responses_encrypted_reasoning_for_stateless_clients(oai):
    """include reasoning.encrypted_content (Codex with store off): the reasoning item carries an opaque
    `encrypted_content`, whole and streamed, that the client replays (and this server drops)."""
    ask = {"model": MODEL, "input": "hello", "store": False, "include": ["reasoning.encrypted_content"], **GREEDY}
    r = oai.responses.create(**ask)
    opaque = r.output[0].encrypted_content
    assert r.output[0].type == "reasoning" and base64.b64decode(opaque).decode() == "Hmm so"
    with oai.responses.stream(**ask) as stream:
        done = [e.item for e in stream if e.type == "response.output_item.done"]
    assert done[0].type == "reasoning" and done[0].encrypted_content == opaque
    plain = oai.responses.create(model=MODEL, input="hello", **GREEDY)
    assert plain.output[0].encrypted_content is None
    replay = oai.responses.create(model=MODEL, input=[
        {"role": "user", "content": "hello"}, r.output[0].model_dump(exclude_none=True),
        {"role": "assistant", "content": "Yes done"}, {"role": "user", "content": "again"}], **GREEDY)
    assert replay.output_text == "Yes done"


# ------------------------------------------------------------------------------------------ end_thinking
def _stream_until_first_delta(client: httpx.Client, path: str, body: dict, headers: dict | None = None):
    """Open a stream; returns (the open response context, its line iterator, the first chunk with a delta)."""
    ctx = client.stream("POST", path, json={**body, "stream": True, **GREEDY}, headers=headers or {})
    response = ctx.__enter__()
    lines = response.iter_lines()
    for line in lines:
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            choice = chunk["choices"][0]
            if choice.get("text") or any(v for k, v in (choice.get("delta") or {}).items() if k != "role"):
                return ctx, lines, chunk
    raise AssertionError("the stream ended before any text")


def test_end_thinking_ends_the_block_and_the_answer_continues(thinking_server):
    looping = {"model": MODEL, "max_tokens": 3000, "continue_final_message": True, "add_generation_prompt": False}
    with httpx.Client(base_url=thinking_server.url, timeout=60) as client:
        end = lambda rid: client.post(f"/v1/requests/{rid}/end_thinking")  # noqa: E731
        # a block that never ends by itself, found by the client's X-Request-Id
        ctx, lines, first = _stream_until_first_delta(client, "/v1/chat/completions", {
            **looping, "messages": [*HELLO, {"role": "assistant", "content": "<think>ok"}]},
            headers={"X-Request-Id": "think-1"})
        assert first["choices"][0]["delta"]["reasoning_content"] == "ok"
        ending = end("think-1")
        assert ending.status_code == 200 and ending.json()["status"] == "ending"
        content, reasoning, finish = "", "", None
        for line in lines:
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                content += choice["delta"].get("content") or ""
                reasoning += choice["delta"].get("reasoning_content") or ""
                finish = choice["finish_reason"] or finish
        ctx.__exit__(None, None, None)
        assert (content, finish) == ("Yes done", "stop") and set(reasoning.split("ok")) == {""}
        assert end("think-1").status_code == 404 and end("no-such-request").status_code == 404
        # a thinking request whose block is already over
        ctx, _, first = _stream_until_first_delta(client, "/v1/chat/completions", {
            **looping, "messages": [*HELLO, {"role": "assistant", "content": "<think>Hmm</think>\n\nzz"}]})
        try:
            assert first["choices"][0]["delta"]["content"] == "zz"
            closed = end(first["id"])
            assert closed.status_code == 200 and closed.json()["status"] == "already_closed"
        finally:
            ctx.__exit__(None, None, None)
        # a request that does not split reasoning (a raw completion) is not a thinking request
        ctx, _, first = _stream_until_first_delta(client, "/v1/completions", {
            "model": MODEL, "prompt": "<think>ok", "max_tokens": 3000})
        try:
            refused = end(first["id"])
            assert refused.status_code == 409 and refused.json()["error"]["code"] == "not_thinking"
        finally:
            ctx.__exit__(None, None, None)
    _wait_for_idle(thinking_server.url)


def test_the_answer_keeps_its_reserve_of_max_tokens(oai):
    """A block that would think forever ("ok") is ended where the answer reserve begins (imp's max(256,
    max_tokens/4), at most half): the reply is reasoning, then the whole answer, not max_tokens of thinking."""
    for max_tokens in (40, 600):
        r = oai.chat.completions.create(
            model=MODEL, max_tokens=max_tokens, messages=[*HELLO, {"role": "assistant", "content": "<think>ok"}],
            extra_body={"continue_final_message": True, "add_generation_prompt": False}, **GREEDY)
        msg, usage = r.choices[0].message, r.usage
        assert (msg.content, r.choices[0].finish_reason) == ("Yes done", "stop")
        assert set(msg.reasoning_content.split("ok")) == {""}
        budget = max_tokens - answer_reserve(max_tokens)
        # the block's tokens: its "ok"s up to the budget, then the forced end (</think> and the blank line)
        assert budget <= usage.completion_tokens_details.reasoning_tokens <= budget + 2
    assert (answer_reserve(40), answer_reserve(600), answer_reserve(4096)) == (20, 256, 1024)


def test_a_budget_needs_the_newest_token_only_when_it_may_be_reached():
    """Asynchronous scheduling (and drafts) stay on for a budgeted block until its last tokens."""
    markers = ThinkMarkers(1, 2, (2, 3))
    t = ThinkTracker(markers, [1], budget=5)   # the prompt opened the block
    seen = []
    for _ in range(5):
        seen.append((t.may_force, t.may_force_within(3)))
        t.observe(7)
    assert seen == [(False, False), (False, False), (False, True), (False, True), (True, True)]
    assert t.forced_token == 2 and t.may_force


def _wait_for_idle(url: str, timeout: float = 30.0) -> None:
    """The cancelled streams' requests end and give back every KV block."""
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(url + "/health").json()
        if health["num_running"] == 0 and health["num_free_blocks"] == health["baseline_free_blocks"]:
            return
        assert time.monotonic() < deadline, health
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------ grammars
def test_a_grammar_applies_after_the_think_block(thinking_model):
    """The constraint's matcher starts after </think>: the block is free, the answer follows the grammar."""
    import jax.numpy as jnp
    import llguidance

    from imp_jax.model.formats.loader import load_model
    from imp_jax.runtime.config import EngineConfig
    from imp_jax.runtime.core.engine import EngineCore
    from imp_jax.runtime.request import GenerationRequest, SamplingParams
    from imp_jax.runtime.parallel.sharding import default_mesh

    path, ids = thinking_model
    loaded = load_model(path, dtype="float32")
    config = EngineConfig(model=str(path), max_model_len=64, max_num_seqs=1, max_num_batched_tokens=16,
                          block_size=16, num_kv_blocks=8)
    shape = loaded.model.kv_cache_shape(8, 16)
    core = EngineCore(loaded, config, (jnp.zeros(shape), jnp.zeros(shape)), 8, default_mesh())
    core.step_fn.warm_up()
    prompt = loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template(HELLO), add_special_tokens=False)
    events = []
    core.add_request(GenerationRequest("g", prompt, SamplingParams(temperature=0.0, max_tokens=20), reasoning=True,
                                       constraint=llguidance.LLMatcher.grammar_from_regex("zzok")),
                     events.append)
    while core.has_work():
        core.step()
    reasoning, text = "".join(e.reasoning_text for e in events), "".join(e.text for e in events)
    assert (reasoning, text, events[-1].finish_reason) == ("Hmm so", "zzok", "stop")
    assert core.pool.num_free_blocks == core.baseline_free_blocks



# ------------------------------------------------------------------------------------------ tools
PING = {"name": "ping", "description": "Ping", "parameters": {"type": "object", "properties": {}}}


def test_reasoning_then_a_required_tool_call_on_each_dialect(oai, claude):
    """tool_choice 'required' (Hermes preamble: the template has no tools): the think block stays free and is
    never parsed for calls, the answer is the call; reasoning first, then the call, whole and streamed."""
    chat = {"model": MODEL, "messages": HELLO, "tools": [{"type": "function", "function": PING}],
            "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 120, **GREEDY}
    r = oai.chat.completions.create(**chat)
    msg = r.choices[0].message
    assert (msg.reasoning_content, msg.content, r.choices[0].finish_reason) == ("Hmm so", None, "tool_calls")
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [("ping", "{}")]
    deltas = [c.choices[0].delta for c in oai.chat.completions.create(**chat, stream=True) if c.choices]
    kinds = [k for d in deltas for k in ("reasoning_content", "content", "tool_calls") if getattr(d, k, None)]
    assert kinds == sorted(kinds, key=["reasoning_content", "content", "tool_calls"].index) and "tool_calls" in kinds
    assert "".join(d.reasoning_content or "" for d in deltas if hasattr(d, "reasoning_content")) == "Hmm so"

    messages = {"model": MODEL, "max_tokens": 120, "messages": HELLO, "extra_body": GREEDY,
                "thinking": {"type": "enabled", "budget_tokens": 1024},
                "tools": [{"name": "ping", "input_schema": PING["parameters"]}],
                "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    m = claude.messages.create(**messages)
    assert [b.type for b in m.content] == ["thinking", "tool_use"] and m.stop_reason == "tool_use"
    assert (m.content[0].thinking, m.content[1].name, m.content[1].input) == ("Hmm so", "ping", {})
    with claude.messages.stream(**messages) as stream:
        starts = [(ev.index, ev.content_block.type) for ev in stream if ev.type == "content_block_start"]
        final = stream.get_final_message()
    assert starts == [(0, "thinking"), (1, "tool_use")]
    assert [b.type for b in final.content] == ["thinking", "tool_use"] and final.content[1].input == {}

    responses = {"model": MODEL, "input": "hello", "tools": [{"type": "function", **PING}],
                 "tool_choice": "required", "parallel_tool_calls": False, "max_output_tokens": 120, **GREEDY}
    x = oai.responses.create(**responses)
    assert [o.type for o in x.output] == ["reasoning", "function_call"] and x.status == "completed"
    assert (x.output[0].content[0].text, x.output[1].name, x.output[1].arguments) == ("Hmm so", "ping", "{}")
    with oai.responses.stream(**responses) as stream:
        added = [(e.output_index, e.item.type) for e in stream if e.type == "response.output_item.added"]
        final = stream.get_final_response()
    assert added == [(0, "reasoning"), (1, "function_call")]
    assert [o.type for o in final.output] == ["reasoning", "function_call"]
