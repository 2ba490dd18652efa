"""POST /infill (llama.cpp): the FIM prompt layout, its /completion-shaped answers, and its 400s.

Generation runs on the FakeEngine over a tokenizer with FIM tokens: the real SmolLM2 GGUF has none
(which the live server shows: a 400 fim_not_supported)."""
from __future__ import annotations

import json

import httpx

from imp_jax.server.infill import InfillRequest
from imp_jax.server.prompts import infill_prompt
from support.servers import (FAKE_SCRIPT, MODEL, LiveServer, fake_server, fake_tokenizer, live_server,  # noqa: F401
                             parse_sse)


def test_prompt_layout_is_extra_then_prefix_suffix_middle_prompt() -> None:
    tok = fake_tokenizer(fim=True)
    req = InfillRequest.model_validate({"input_prefix": "def f(x):", "input_suffix": "return x",
                                        "input_extra": [{"filename": "a.py", "text": "hello"}], "prompt": " y"})
    ids = infill_prompt(req, tok)
    text = tok.decode(ids, skip_special_tokens=False)
    # no file separator in this vocabulary: the extra chunk is its text and a newline
    assert text == "hello\n<fim_prefix>def f(x):<fim_suffix>return x<fim_middle> y"


def test_infill_whole_and_streamed(fake_server) -> None:
    url, _ = fake_server
    body = {"input_prefix": "def f(x):", "input_suffix": "return x", "n_predict": 5, "temperature": 0}
    r = httpx.post(url + "/infill", json=body, timeout=30)
    assert r.status_code == 200, r.text
    out = r.json()
    script = fake_tokenizer().encode(FAKE_SCRIPT, add_special_tokens=False)[:5]
    assert out["content"] == fake_tokenizer().decode(script) and out["tokens"] == script
    assert out["stop"] is True and out["stop_type"] == "limit" and out["tokens_predicted"] == 5
    assert out["tokens_evaluated"] == len(infill_prompt(InfillRequest.model_validate(body), fake_tokenizer()))

    with httpx.stream("POST", url + "/infill", json={**body, "stream": True}, timeout=30) as s:
        frames = parse_sse(s.read().decode())
    chunks = [json.loads(d) for _, d in frames]
    assert all(c["stop"] is False for c in chunks[:-1]) and chunks[-1]["stop"] is True
    assert "".join(c["content"] for c in chunks) == out["content"]
    assert chunks[-1]["tokens_predicted"] == 5 and chunks[-1]["stop_type"] == "limit"


def test_infill_bad_input_is_a_400_naming_the_field(fake_server) -> None:
    url, _ = fake_server
    for body, param in (({"n_predict": 0}, "n_predict"), ({"n_predict": 3, "max_tokens": 3}, "n_predict"),
                        ({"n": 2}, "n"), ({"input_prefix": 5}, "input_prefix"),
                        ({"input_extra": [{"filename": "a"}]}, "input_extra[0].text"),
                        ({"repeat_penalty": 1.1, "repetition_penalty": 1.1}, "repeat_penalty")):
        r = httpx.post(url + "/infill", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_a_model_without_fim_tokens_is_a_400(live_server: LiveServer) -> None:
    r = httpx.post(live_server.url + "/infill", json={"model": MODEL, "input_prefix": "x"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "fim_not_supported"


def test_infill_grammar_and_json_schema_reach_the_engine(fake_server, monkeypatch) -> None:
    """The structured-output fields are compiled (a bad one is a 400 naming it) and handed to the engine as
    the request's constraint. The FakeEngine does not enforce constraints (test_structured.py does, on the
    real engine), so the submitted request is observed here: SmolLM2 has no FIM tokens for /infill."""
    url, engine = fake_server
    seen = []
    generate = engine.generate
    monkeypatch.setattr(engine, "generate", lambda req, *a, **k: (seen.append(req), generate(req, *a, **k))[1])
    base = {"input_prefix": "def f(x):", "input_suffix": "return x", "n_predict": 2}
    for extra in ({"grammar": 'root ::= "a" | "b"'}, {"json_schema": {"type": "object"}}):
        r = httpx.post(url + "/infill", json={**base, **extra}, timeout=30)
        assert r.status_code == 200, r.text
        assert seen[-1].constraint, extra
    for extra, param in (({"grammar": "root ::= ("}, "grammar"), ({"json_schema": 5}, "json_schema"),
                         ({"prompt_logprobs": 2}, "prompt_logprobs"), ({"suffix": "x"}, "suffix"),
                         ({"stream_options": {"include_usage": True}, "stream": True}, "stream_options")):
        r = httpx.post(url + "/infill", json={**base, **extra}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
