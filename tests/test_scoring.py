"""POST /v1/score and POST /v1/decide: the raw next-token distribution over caller-given tokens, no decoding.

Parity is with transformers' own float32 load of the SmolLM2 GGUF (the `hf_smollm2` reference of
test_smollm2.py) on the very token ids a `--gemm exact` server scored (the default server runs this
quantised GGUF on int8 activations, llama.cpp's arithmetic); bad input runs on the fake server (it is
refused before any engine work).
"""
from __future__ import annotations

import concurrent.futures

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.metrics_text import parse, value
from support.servers import MODEL, LiveServer, OpsServer, engine_stats, fake_server, live_server, wait_idle  # noqa: F401

from imp_jax.runtime.execution.sampling import RowSpec, build_sampling_tensors, sample
from imp_jax.server.scoring import MAX_CANDIDATES, decide_text

QUESTION = "What is the capital of France? Answer in one word."
CHAT = [{"role": "user", "content": QUESTION}]


# ------------------------------------------------------------------------------------------- unit
def test_sampler_reports_raw_logprobs_at_bias_slots() -> None:
    """Whatever the processing (penalty, temperature, bias, truncation), bias slots read log_softmax of the raw logits."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 50)).astype(np.float32) * 3
    rows = [RowSpec(temperature=0.7, repetition_penalty=1.3, history=[1, 2, 3], top_k=5, logit_bias={4: 0.0, 7: 5.0}),
            RowSpec(temperature=0.0, logit_bias={}),
            RowSpec(temperature=0.0, logit_bias={49: -100.0})]
    t = build_sampling_tensors(rows, num_rows_bucket=4, vocab_size=50, history_len=8, max_bias=4, with_mask=True)
    out = sample(jnp.asarray(np.vstack([logits, logits[:1]])), t, jax.random.key(0))
    raw = np.asarray(out.bias_raw_logprobs)
    ref = logits - np.log(np.sum(np.exp(logits.astype(np.float64)), axis=-1, keepdims=True))
    np.testing.assert_allclose(raw[0, :2], ref[0, [4, 7]], atol=1e-5)
    np.testing.assert_allclose(raw[2, :1], ref[2, [49]], atol=1e-5)
    assert not raw[0, 2:].any() and not raw[1].any() and not raw[3].any()   # padding slots read 0


def test_decide_renders_the_documented_text() -> None:
    assert decide_text("Which is a fruit?", ["Carrot", "Apple"]) == (
        "Which is a fruit?\n\nA. Carrot\nB. Apple\n\nAnswer with the letter of the correct option only.")


# --------------------------------------------------------------------------------------- bad input
BAD = [
    ("/v1/score", {"prompt": "hi"}, "candidates"),
    ("/v1/score", {"prompt": "hi", "candidates": []}, "candidates"),
    ("/v1/score", {"prompt": "hi", "candidates": ["a"] * (MAX_CANDIDATES + 1)}, "candidates"),
    ("/v1/score", {"prompt": "hi", "candidates": ["a", ""]}, "candidates[1]"),
    ("/v1/score", {"prompt": "hi", "candidates": [10**6]}, "candidates[0]"),
    ("/v1/score", {"prompt": "hi", "candidates": [-1]}, "candidates[0]"),
    ("/v1/score", {"prompt": "hi", "candidates": [True]}, "candidates[0]"),
    ("/v1/score", {"prompt": "hi", "candidates": [{"x": 1}]}, "candidates[0]"),
    ("/v1/score", {"candidates": ["a"]}, "prompt"),
    ("/v1/score", {"prompt": "hi", "messages": CHAT, "candidates": ["a"]}, "messages"),
    ("/v1/score", {"prompt": "", "candidates": ["a"]}, "prompt"),
    ("/v1/score", {"prompt": [], "candidates": ["a"]}, "prompt"),
    ("/v1/score", {"prompt": [5, 10**6], "candidates": ["a"]}, "prompt"),
    ("/v1/score", {"messages": [], "candidates": ["a"]}, "messages"),
    ("/v1/score", {"messages": [{"role": "user"}], "candidates": ["a"]}, "messages[0].content"),
    ("/v1/score", {"prompt": "hi " * 400, "candidates": ["a"]}, "prompt"),          # over the fake's 256 context
    ("/v1/decide", {"question": "Q?", "options": ["only one"]}, "options"),
    ("/v1/decide", {"question": "Q?", "options": [f"o{i}" for i in range(27)]}, "options"),
    ("/v1/decide", {"question": "Q?", "options": ["a", " "]}, "options[1]"),
    ("/v1/decide", {"question": "Q?"}, "options"),
    ("/v1/decide", {"question": "", "options": ["a", "b"]}, "question"),
    ("/v1/decide", {"options": ["a", "b"]}, "question"),
    ("/v1/decide", {"question": "Q?", "messages": CHAT, "options": ["a", "b"]}, "messages"),
    ("/v1/decide", {"messages": [{"role": "assistant", "content": "x"}], "options": ["a", "b"]}, "messages"),
    ("/v1/decide", {"messages": CHAT, "system": "s", "options": ["a", "b"]}, "system"),
    ("/v1/decide", {"question": "Q?", "system": "s", "instructions": "i", "options": ["a", "b"]}, "instructions"),
    ("/v1/decide", {"question": "Q? " * 400, "options": ["a", "b"]}, "question"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{p}:{param}:{i}" for i, (p, _, param) in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_field(fake_server, path: str, body: dict, param: str) -> None:
    url, _ = fake_server
    r = httpx.post(url + path, json={"model": "fake-model", **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_truncate_keeps_the_end_of_a_long_prompt(fake_server) -> None:
    """`truncate: true` turns the over-long 400 into a cut prompt (the fake engine then refuses the
    raw logprobs it cannot compute, after the cut: its 400 names `stop`, not the prompt)."""
    url, _ = fake_server
    r = httpx.post(url + "/v1/score", json={"model": "fake-model", "prompt": "hi " * 400, "candidates": ["a"],
                                            "truncate": True}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text


@pytest.mark.parametrize("path", ["/v1/score", "/v1/decide"])
def test_unknown_model_is_a_404(fake_server, path: str) -> None:
    url, _ = fake_server
    body = ({"prompt": "hi", "candidates": ["a"]} if path == "/v1/score"
            else {"question": "Q?", "options": ["a", "b"]})
    r = httpx.post(url + path, json={"model": "nope", **body}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text


@pytest.mark.parametrize("path", ["/v1/score", "/v1/decide"])
def test_priority_and_cache_prompt_reach_the_engine(fake_server, monkeypatch, path: str) -> None:
    """Both are honoured as on generation routes: the engine request carries them. (The FakeEngine then refuses
    the raw logprobs it cannot compute, a 400 naming `stop`; the submitted request is what is checked.)"""
    url, engine = fake_server
    seen = []
    generate = engine.generate
    monkeypatch.setattr(engine, "generate", lambda req, *a, **k: (seen.append(req), generate(req, *a, **k))[1])
    body = ({"prompt": "hi", "candidates": ["a"]} if path == "/v1/score"
            else {"question": "Q?", "options": ["a", "b"]})
    httpx.post(url + path, json={"model": "fake-model", **body, "priority": 3, "cache_prompt": True}, timeout=30)
    assert seen and seen[-1].priority == 3 and seen[-1].cache_prompt is True
    for extra, param in (({"priority": "high"}, "priority"), ({"temperature": 0.5}, "temperature"),
                         ({"stream": True}, "stream")):
        r = httpx.post(url + path, json={"model": "fake-model", **body, **extra}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---------------------------------------------------------------------------------- real model
pytestmark_real = pytest.mark.real_model


def _post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json={"model": MODEL, **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _tokenize(url: str, **body) -> list[int]:
    r = httpx.post(url + "/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _hf_logprobs(hf_model, ids: list[int]) -> np.ndarray:
    """transformers' log_softmax over the vocabulary at the position after `ids`, in float64."""
    import torch
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, -1].double().numpy()
    return logits - np.log(np.sum(np.exp(logits - logits.max()))) - logits.max()


def _softmax_over(lp: np.ndarray, ids: list[int]) -> dict[int, float]:
    distinct = list(dict.fromkeys(ids))
    x = lp[distinct]
    p = np.exp(x - x.max())
    return dict(zip(distinct, p / p.sum()))


@pytest.fixture(scope="module")
def score_server(live_server: LiveServer) -> LiveServer:
    wait_idle(live_server.url)
    return live_server


@pytestmark_real
def test_score_matches_transformers(exact_server: LiveServer, hf_smollm2) -> None:
    url = exact_server.url
    candidates = ["Paris", " Paris", "London", "Lyon", "Parisian", 2]   # "Parisian" shares "Paris"'s first token
    got = _post(url, "/v1/score", {"messages": CHAT, "candidates": candidates})
    ids = _tokenize(url, messages=CHAT)
    assert got["usage"]["prompt_tokens"] == len(ids) and got["object"] == "score" and not got["truncated"]
    first = [_tokenize(url, content=c)[0] if isinstance(c, str) else c for c in candidates]
    res = got["results"]
    assert [r["token_id"] for r in res] == first and [r["candidate"] for r in res] == candidates
    assert res[0]["token"] == "Paris" and res[1]["token"] == " Paris" and res[0]["token_id"] != res[1]["token_id"]
    assert res[4]["token_id"] == res[0]["token_id"] and res[4]["probability"] == res[0]["probability"]
    ref_lp = _hf_logprobs(hf_smollm2, ids)
    ref_p = _softmax_over(ref_lp, first)
    for r in res:
        assert abs(r["probability"] - ref_p[r["token_id"]]) <= 1e-4, (r, ref_p)
        assert abs(r["logprob"] - ref_lp[r["token_id"]]) <= 1e-3, (r, ref_lp[r["token_id"]])
    distinct = {r["token_id"]: r["probability"] for r in res}
    assert len(distinct) == len(res) - 1 and abs(sum(distinct.values()) - 1) <= 1e-6
    # a string prompt and its token ids score the same
    text_prompt = "The capital of France is"
    by_text = _post(url, "/v1/score", {"prompt": text_prompt, "candidates": [" Paris", " London"]})
    by_ids = _post(url, "/v1/score", {"prompt": _tokenize(url, prompt=text_prompt), "candidates": [" Paris", " London"]})
    assert [r["probability"] for r in by_text["results"]] == pytest.approx(
        [r["probability"] for r in by_ids["results"]], abs=1e-6)
    assert by_text["results"][0]["probability"] > 0.5


@pytestmark_real
def test_decide_matches_transformers_on_the_rendered_prompt(exact_server: LiveServer, hf_smollm2) -> None:
    url = exact_server.url
    options = ["Berlin", "Paris", "Madrid", "Rome"]
    got = _post(url, "/v1/decide", {"question": "What is the capital of France?", "options": options,
                                    "system": "You are a geography expert."})
    rendered = [{"role": "system", "content": "You are a geography expert."},
                {"role": "user", "content": decide_text("What is the capital of France?", options)}]
    ids = _tokenize(url, messages=rendered)
    assert got["usage"]["prompt_tokens"] == len(ids) and got["object"] == "decision"
    letters = [_tokenize(url, content=L)[0] for L in "ABCD"]
    ref_p = _softmax_over(_hf_logprobs(hf_smollm2, ids), letters)
    dist = got["distribution"]
    assert [d["letter"] for d in dist] == list("ABCD") and [d["option"] for d in dist] == options
    assert [d["token_id"] for d in dist] == letters
    for d in dist:
        assert abs(d["probability"] - ref_p[d["token_id"]]) <= 1e-4, (d, ref_p)
    best = max(range(4), key=lambda i: ref_p[letters[i]])
    assert got["pick"] == {"letter": "ABCD"[best], "index": best, "option": options[best],
                           "probability": dist[best]["probability"]}
    # with messages: the options go into the last user turn; the same prompt as the question form
    via_messages = _post(url, "/v1/decide", {"messages": [rendered[0], {"role": "user", "content":
                                             "What is the capital of France?"}], "options": options})
    assert via_messages["usage"]["prompt_tokens"] == len(ids)
    assert [d["probability"] for d in via_messages["distribution"]] == pytest.approx(
        [d["probability"] for d in dist], abs=1e-5)


@pytestmark_real
def test_concurrent_scoring_equals_alone_and_frees_the_pool(score_server: LiveServer) -> None:
    """Score and decide requests batched with each other and a streaming chat answer the same as alone;
    after them the KV pool is back at its baseline and nothing was compiled."""
    url = score_server.url
    jobs = [("/v1/score", {"messages": [{"role": "user", "content": f"Pick a number, {i}."}],
                           "candidates": ["1", "2", "3", "Seven"]}) for i in range(4)]
    jobs += [("/v1/decide", {"question": f"Which is largest? ({i})", "options": ["ant", "whale", "cat"]})
             for i in range(3)]
    jobs += [("/v1/score", {"prompt": "Once upon a time there was a long story about " * 6,
                            "candidates": [" a", " the", " dragons"]})]
    alone = [_post(url, p, b) for p, b in jobs]
    before = engine_stats(url)

    def chat() -> int:
        r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 24,
                                                           "stream": True, "temperature": 0}, timeout=300)
        return r.status_code

    with concurrent.futures.ThreadPoolExecutor(len(jobs) + 1) as pool:
        streaming = pool.submit(chat)
        together = list(pool.map(lambda job: _post(url, *job), jobs))
        assert streaming.result() == 200

    def probs(res: dict) -> list[float]:
        return [r["probability"] for r in res.get("results") or res["distribution"]]

    for a, t in zip(alone, together):
        assert probs(t) == pytest.approx(probs(a), abs=1e-4)
        assert (a.get("pick") or {}).get("letter") == (t.get("pick") or {}).get("letter")
    stats = wait_idle(url)
    assert stats["num_free_blocks"] == stats["baseline_free_blocks"]
    assert stats["compilations_after_warmup"] == before["compilations_after_warmup"] == 0
    assert stats["num_steps"] > before["num_steps"]


@pytestmark_real
def test_over_long_prompt_is_a_400_unless_truncate(score_server: LiveServer) -> None:
    url = score_server.url
    long_ids = [28] * 1100   # past the live server's 1024-token context
    r = httpx.post(url + "/v1/score", json={"model": MODEL, "prompt": long_ids, "candidates": ["a"]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert r.json()["error"]["param"] == "prompt"
    got = _post(url, "/v1/score", {"prompt": long_ids, "candidates": ["a"], "truncate": True})
    assert got["truncated"] and got["usage"]["prompt_tokens"] == 1023
    wait_idle(url)


@pytestmark_real
def test_metrics_and_request_log_cover_score_and_decide(ops_server: OpsServer) -> None:
    first = parse(ops_server.first_metrics)
    for endpoint in ("score", "decide"):
        assert value(first, "imp_endpoint_requests_total", endpoint=endpoint) == 0
    for path, body in (("/v1/score", {"prompt": "Hello", "candidates": [" world", "!"]}),
                       ("/v1/decide", {"question": "Yes or no?", "options": ["yes", "no"]})):
        r = httpx.post(ops_server.url + path, json={"model": MODEL, **body}, headers=ops_server.auth(), timeout=120)
        assert r.status_code == 200, r.text
    wait_idle(ops_server.url)
    m = parse(ops_server.metrics())
    for endpoint in ("score", "decide"):
        assert value(m, "imp_endpoint_requests_total", endpoint=endpoint) >= 1
        assert value(m, "imp_endpoint_request_duration_seconds_count", endpoint=endpoint) >= 1
    lines = {line["endpoint"]: line for line in ops_server.log_lines() if line.get("endpoint") in ("score", "decide")}
    assert set(lines) == {"score", "decide"}
    for path, line in (("/v1/score", lines["score"]), ("/v1/decide", lines["decide"])):
        assert line["path"] == path and line["status"] == 200 and line["outcome"] == "ok"
        assert line["prompt_tokens"] > 0 and line["completion_tokens"] == 0   # nothing is decoded
