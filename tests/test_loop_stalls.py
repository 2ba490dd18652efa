"""The event loop never stalls (issue 38, item 4): /health answers within 100 ms while one client sends
the largest requests an 8k-context model takes. A FakeEngine app in this process (the engine plays no
part: what is measured is the server's own work on the loop, tokenizing, detokenizing and serialising;
support/servers.py's docstring says why the fake exists); the hostile bodies are serialised before the probe
starts and the replies read after it stops, so the test's own JSON work holds no GIL meanwhile."""
from __future__ import annotations

import gc
import json
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from support.servers import (MODEL, FakeEngine, LiveServer, app_in_thread, engine_stats, fake_tokenizer,
                             live_server, probe_health, wait_for)  # noqa: F401 (live_server: a fixture)

from imp_jax.model.text import tokenizer as tokenizer_module
from imp_jax.server.limits import json_pieces
from imp_jax.server.tokens import MAX_PIECES

CONTEXT = 8192
HOSTILE_TEXT = "\U0001D518" * (32 * CONTEXT)   # the prompt-character cap of an 8k model, 4 UTF-8 bytes each
JSON = {"Content-Type": "application/json"}


class WideEncoder:
    """An embedding model of 1024 dimensions that answers at once: what is measured is the server's work on
    a 2048-vector reply (~25 MB of JSON), not the model's."""

    served_name, task, state, error = "wide-embed", "embed", "ready", None
    max_model_len, vocab_size, dimensions, normalize, tokenizer, in_flight = 64, 100, 1024, True, None, 0

    def start(self) -> None:
        pass

    async def wait_ready(self) -> None:
        pass

    def shutdown(self, timeout: float = 10.0) -> None:
        pass

    def stats(self) -> dict:
        return {}

    VECTORS = np.random.default_rng(0).standard_normal((2048, 1024)).astype(np.float32)   # made once, not on the loop

    async def run(self, items: list) -> np.ndarray:
        return self.VECTORS[:len(items)]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    from imp_jax.server.app import create_app
    from imp_jax.server.encoders import install_encoders

    engine = FakeEngine(fake_tokenizer(), max_model_len=CONTEXT)
    engine.start()
    app = create_app(engine)
    install_encoders(app, [WideEncoder()])
    with app_in_thread(app) as base:
        wait_for(base + "/ready", 200, timeout=30)
        yield base


def health_latencies_during(url: str, requests: list[tuple[str, bytes]]) -> tuple[list[float], list[httpx.Response]]:
    """Probe /health every 10 ms from another thread while `requests` (path, body) are sent one by one. The
    app shares this process with the whole suite: what earlier tests left on the heap is collected and
    frozen first, so a garbage-collector pass over it is not counted as the server's stall."""
    stop, latencies = threading.Event(), []
    prober = threading.Thread(target=probe_health, args=(url, stop, latencies, 0.01))
    gc.collect()
    gc.freeze()
    prober.start()
    try:
        time.sleep(0.1)
        with httpx.Client(base_url=url, timeout=120) as client:
            replies = [client.post(path, content=body, headers=JSON) for path, body in requests]
        time.sleep(0.1)
    finally:
        stop.set()
        prober.join()
        gc.unfreeze()
    return latencies, replies


def latencies_of_a_stall_free_run(url: str, requests: list[tuple[str, bytes]]) -> tuple[list[float], list[httpx.Response]]:
    """`health_latencies_during`, once more when a probe took 100 ms or more: on a shared 2-core machine (CI runs
    the suite on two workers) the OS or another process can hold this process's threads off the cores for a
    moment, once; a stall of the loop itself comes back with the same requests. The second run counts then."""
    latencies, replies = health_latencies_during(url, requests)
    if latencies and max(latencies) >= 0.1:
        latencies, replies = health_latencies_during(url, requests)
    return latencies, replies


def largest_image_url() -> str:
    """A PNG at the default pixel cap (8K UHD, 100 MB as RGB pixels) with transparency, small as sent."""
    import base64
    import io

    from PIL import Image

    im = Image.new("RGBA", (7680, 4320), (20, 200, 90, 128))
    im.paste((250, 10, 10, 255), (0, 0, 640, 480))
    buf = io.BytesIO()
    im.save(buf, "PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_health_answers_within_100_ms_through_the_largest_tokenizer_work(url: str) -> None:
    ids = list(range(256)) * 1500   # 384,000 ids to detokenize
    picture = {"type": "image_url", "image_url": {"url": largest_image_url()}}   # decoded, then refused: no vision
    hostile = [("/v1/chat/completions", json.dumps({"model": "fake-model", "messages": [
                   {"role": "user", "content": [{"type": "text", "text": "hi"}, picture]}]}).encode()),
               ("/tokenize", json.dumps({"content": HOSTILE_TEXT}).encode()),
               ("/tokenize", json.dumps({"prompt": HOSTILE_TEXT, "with_pieces": True}).encode()),
               ("/tokenize", json.dumps({"messages": [{"role": "user", "content": HOSTILE_TEXT[:-100]}]}).encode()),
               ("/detokenize", json.dumps({"tokens": ids}).encode()),
               ("/v1/embeddings", json.dumps({"model": "wide-embed", "input": [[1, 2, 3]] * 2048}).encode())]
    latencies, replies = latencies_of_a_stall_free_run(url, hostile)
    assert [r.status_code for r in replies] == [400, 200, 400, 200, 200, 200], [r.text[:200] for r in replies]
    assert replies[0].json()["error"]["code"] == "model_not_multimodal"   # after decoding all 33 MP of it
    replies = replies[1:]
    assert len(replies[4].json()["data"]) == 2048
    assert replies[0].json()["count"] > 500_000
    assert replies[1].json()["error"]["param"] == "with_pieces"
    assert len(replies[3].json()["content"]) > 100_000
    assert len(latencies) >= 10 and max(latencies) < 0.1, sorted(latencies)[-5:]


def test_health_answers_within_100_ms_through_prompt_logprobs_of_a_long_prompt(live_server: LiveServer) -> None:
    """The real engine (SmolLM2): a ~900-token prompt scored with the top 20 at every position, n = 4, one
    copy of the prompt's logprobs per choice (~4.5 MB of JSON). The engine's reading and the reply's
    building and serialising all happen off the loop. Measured once the background warm-up compiles are done
    (tracing a program holds the GIL in long stretches: start-up, not a request's doing)."""
    deadline = time.monotonic() + 300
    while (stats := engine_stats(live_server.url))["programs_compiled"] < stats["programs_total"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)
    body = {"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog. " * 90, "n": 4, "max_tokens": 4,
            "temperature": 0.7, "seed": 1, "prompt_logprobs": 20}
    latencies, replies = latencies_of_a_stall_free_run(live_server.url, [("/v1/completions", json.dumps(body).encode())])
    choices = replies[0].json()["choices"]
    assert len(choices) == 4 and all(len(c["prompt_logprobs"]) > 800 for c in choices)
    assert len(latencies) >= 10 and max(latencies) < 0.1, sorted(latencies)[-5:]


def test_pieces_are_served_up_to_their_cap(url: str) -> None:
    r = httpx.post(url + "/tokenize", json={"content": "hello world " * 100, "with_pieces": True}, timeout=60)
    pieces = r.json()["tokens"]
    assert r.status_code == 200 and "".join(p["piece"] for p in pieces) == "hello world " * 100
    assert MAX_PIECES >= 1 << 16


def test_long_inputs_go_through_the_gil_free_batch_calls(monkeypatch) -> None:
    """Above GIL_FREE_ABOVE, encode and decode use the tokenizers batch API (which releases the GIL), with
    the same ids and text as the plain calls."""
    tok = fake_tokenizer()
    text = "hello world, héllo 🙂 " * 400
    plain = tok._tok.encode(text).ids
    monkeypatch.setattr(tokenizer_module, "GIL_FREE_ABOVE", 10)
    assert tok.encode(text) == plain and tok.decode(plain) == tok._tok.decode(plain)


def test_the_pieces_add_up_to_what_jsonify_writes() -> None:
    reply = {"data": [{"embedding": [0.1 * i] * 300, "index": i} for i in range(500)], "model": "m",
             "choices": [{"logprobs": {"content": [{"token": "é", "top": [{"t": "x"}]}] * 2000}}], "empty": []}
    dumps = lambda v: json.dumps(v, separators=(",", ":"), sort_keys=True)   # noqa: E731 (Quart's provider)
    assert "".join(json_pieces(reply, dumps)) == dumps(reply)


def test_no_piece_is_much_past_the_slice_when_the_list_starts_small() -> None:
    """prompt_logprobs start with a bare null: a run sized from that first item alone was the whole list,
    one C call of ~1.5 MB per choice (the 0.1 s /health stalls of a 900-token prompt_logprobs request)."""
    from imp_jax.server.limits import SLICE_CHARS

    row = {str(t): {"logprob": -1.5, "rank": t, "decoded_token": "tok"} for t in range(21)}
    reply = {"prompt_logprobs": [None] + [row] * 900 + [{"0": {"logprob": 0.0}}] * 3000}
    dumps = lambda v: json.dumps(v, separators=(",", ":"), sort_keys=True)   # noqa: E731
    pieces = list(json_pieces(reply, dumps))
    assert "".join(pieces) == dumps(reply)
    assert max(len(p) for p in pieces) <= 2 * SLICE_CHARS, max(len(p) for p in pieces)


def test_admin_routes_hold_bodies_to_the_same_limit_even_chunked(url: str) -> None:
    """A chunked body has no Content-Length for the access check: the route itself refuses it past the
    server's body limit (4 MiB here) before parsing, as the dialects' routes do."""
    def chunks():
        yield b'{"path": "'
        for _ in range(80):
            yield b"x" * 65536
        yield b'"}'

    for path in ("/admin/lora/load", "/admin/models/load", "/admin/lora/unload"):
        r = httpx.post(url + path, content=chunks(), headers=JSON, timeout=60)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", (path, r.text[:300])


def test_a_reply_past_the_logprobs_cap_is_a_400_naming_the_field(monkeypatch) -> None:
    """n x tokens x (1 + top alternatives), the prompt's too, is held to MAX_REPLY_LOGPROBS (checked at
    admission with max_tokens resolved, runtime/core/admission.py)."""
    from imp_jax.errors import InvalidRequestError
    from imp_jax.runtime import request as request_module
    from imp_jax.runtime.request import SamplingParams, check_reply_size

    monkeypatch.setattr(request_module, "MAX_REPLY_LOGPROBS", 10_000)
    check_reply_size(SamplingParams(n=2, logprobs=4), prompt_len=100, max_tokens=1000)   # 2 x 1000 x 5
    check_reply_size(SamplingParams(n=8), prompt_len=100_000, max_tokens=100_000)        # no logprobs asked
    for params, field in ((SamplingParams(n=2, logprobs=5), "logprobs"),                 # 2 x 1000 x 6
                          (SamplingParams(n=4, prompt_logprobs=20), "prompt_logprobs")):  # 4 x 200 x 21
        with pytest.raises(InvalidRequestError) as e:
            check_reply_size(params, prompt_len=200, max_tokens=1000)
        assert e.value.param == field and e.value.code == "response_too_large"
    lens = SamplingParams(logprobs=0, logit_lens=4)                                      # 1000 x (1 + 2 x 5)
    check_reply_size(lens, prompt_len=10, max_tokens=1000)
    with pytest.raises(InvalidRequestError) as e:
        check_reply_size(lens, prompt_len=10, max_tokens=1000, lens_layers=2)
    assert e.value.param == "logit_lens"
