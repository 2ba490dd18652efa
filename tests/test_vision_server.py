"""A tiny random Idefics3 (SmolVLM's architecture, scripts/tiny_vlm.py) served end to end: `python -m imp_jax.server`
on loopback, the official openai and anthropic clients and raw HTTP sending pictures, each answer checked against
transformers' greedy `generate` on the same checkpoint, picture and prompt (its own processor expanding `<image>`)."""
from __future__ import annotations

import base64
import io
import sys
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import pytest
from PIL import Image
from support.servers import LiveServer, anthropic_for, openai_for, wait_idle
from support.vision import served_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiny_vlm import hf_processor, write_tiny_idefics3  # noqa: E402  (scripts/, on sys.path above)

MAX_TOKENS = 8
GREEDY = dict(temperature=0.0, top_p=1.0)
GREEDY_EXTRA = dict(top_k=0, min_p=0.0, typical_p=1.0, repetition_penalty=1.0)   # the spec's preset has 1.05


def picture(width: int, height: int, seed: int) -> bytes:
    """A PNG of smooth colour bands (the same seed, the same picture)."""
    rng = np.random.default_rng(seed)
    x = np.linspace(0, 1, width)[None, :, None] * rng.uniform(50, 255, 3) + rng.uniform(0, 60, 3)
    y = np.linspace(0, 1, height)[:, None, None] * rng.uniform(0, 120, 3)
    buf = io.BytesIO()
    Image.fromarray(np.clip(x + y, 0, 255).astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Any, Any]]:
    """The served checkpoint, transformers' model of it and its processor."""
    path = tmp_path_factory.mktemp("tiny-idefics3")
    model = write_tiny_idefics3(path)
    processor = hf_processor(path)
    with served_checkpoint(path, 128) as live:
        yield live, model, processor


def expected(vlm: tuple[LiveServer, Any, Any], question: str, pngs: list[bytes], image_first: bool = False) -> str:
    """transformers' greedy answer to one user turn (the question, then its pictures) rendered as the server does."""
    _, model, processor = vlm
    images = "<image>" * len(pngs)
    content = images + question if image_first else question + images
    text = f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
    pics = [Image.open(io.BytesIO(p)).convert("RGB") for p in pngs]
    inputs = processor(text=[text], images=[pics], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=[1, 3])
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def chat_parts(question: str, pngs: list[bytes]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": question}, *({"type": "image_url", "image_url": {"url": data_url(p)}} for p in pngs)]


def test_openai_chat_with_a_picture_answers_like_transformers(vlm) -> None:
    live = vlm[0]
    png = picture(50, 37, seed=1)
    r = openai_for(live.url).chat.completions.create(
        model=live.model, messages=[{"role": "user", "content": chat_parts("what is this?", [png])}],
        max_tokens=MAX_TOKENS, **GREEDY, extra_body=GREEDY_EXTRA)
    assert r.choices[0].message.content == expected(vlm, "what is this?", [png])
    assert r.usage.prompt_tokens > 16 * 5   # 2 x 2 tiles + the global image, 16 rows each


def test_two_pictures_streamed_and_different_pictures_give_their_own_answers(vlm) -> None:
    live = vlm[0]
    a, b = picture(64, 20, seed=2), picture(20, 64, seed=3)
    client = openai_for(live.url)
    stream = client.chat.completions.create(
        model=live.model, messages=[{"role": "user", "content": chat_parts("compare", [a, b])}],
        max_tokens=MAX_TOKENS, stream=True, **GREEDY, extra_body=GREEDY_EXTRA)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected(vlm, "compare", [a, b])
    answers = {p: client.chat.completions.create(
        model=live.model, messages=[{"role": "user", "content": chat_parts("what is this?", [p])}],
        max_tokens=MAX_TOKENS, **GREEDY, extra_body=GREEDY_EXTRA).choices[0].message.content for p in (a, b)}
    assert answers == {p: expected(vlm, "what is this?", [p]) for p in (a, b)}


def test_the_same_picture_again_reuses_its_prefix_and_a_different_one_does_not(vlm) -> None:
    live = vlm[0]
    client = openai_for(live.url)

    def usage(png: bytes) -> tuple[int, int]:
        r = client.chat.completions.create(
            model=live.model, messages=[{"role": "user", "content": chat_parts("describe it", [png])}],
            max_tokens=2, **GREEDY, extra_body=GREEDY_EXTRA)
        return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens

    first = picture(40, 40, seed=4)
    prompt, _ = usage(first)
    assert usage(first)[1] >= prompt - 16   # every full block, the image's included (blocks of 16)
    other = picture(40, 40, seed=5)   # the same token ids, other pixels: only the text before the image is shared
    assert usage(other)[1] <= 16


def test_anthropic_and_responses_take_pictures(vlm) -> None:
    live = vlm[0]
    png = picture(30, 45, seed=6)
    msg = anthropic_for(live.url).messages.create(
        model=live.model, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                          "data": base64.b64encode(png).decode()}},
            {"type": "text", "text": "what is this?"}]}],
        extra_body={**GREEDY_EXTRA, **GREEDY})   # anthropic 2.x sends sampling knobs only this way
    # Messages joins blocks with a newline: the picture, then the question on the next line
    assert "".join(b.text for b in msg.content if b.type == "text") == expected(vlm, "\nwhat is this?", [png], True)
    r = httpx.post(live.url + "/v1/responses", timeout=120, json={
        "model": live.model, "max_output_tokens": MAX_TOKENS, **GREEDY, **GREEDY_EXTRA,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "what is this?"},
                                               {"type": "input_image", "image_url": data_url(png)}]}]})
    assert r.status_code == 200, r.text
    assert r.json()["output"][-1]["content"][0]["text"] == expected(vlm, "what is this?\n", [png])


def test_bad_input_is_a_400_naming_the_field_and_everything_returns_to_baseline(vlm) -> None:
    live = vlm[0]
    url, model = live.url, live.model
    png = data_url(picture(60, 30, seed=7))
    bad = [  # (body, the field the 400 names)
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
         "messages[0].content[0].image_url.url"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png, "detail": "max"}}]}]},
         "messages[0].content[0].image_url.detail"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]},
         "messages[0].content[0].image_url.url"),
        ({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": png}}]}], "cfg_scale": 2.0}, "cfg_scale"),
    ]
    for body, field in bad:
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={"model": model, "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    # a user's typed "<image>" stays text: no image token, so no rows are asked of it
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "<image> typed as text"}]})
    assert r.status_code == 200, r.text
    # a stream with a picture dropped mid-answer, and n = 2 on a picture
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={
            "model": model, "max_tokens": 50, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": chat_parts("go on", [picture(64, 64, seed=8)])}]}) as r:
        next(line for line in r.iter_lines() if '"content"' in line)
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": model, "max_tokens": 4, "n": 2, "temperature": 0.9, "seed": 3,
        "messages": [{"role": "user", "content": chat_parts("two takes", [picture(64, 64, seed=8)])}]})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    stats = wait_idle(url)
    assert stats["image_rows_used"] == 0 and stats["image_frames_encoded_total"] > 0
    metrics = httpx.get(url + "/metrics").text
    assert "imp_image_rows_used 0.0" in metrics and f"imp_image_frames_encoded_total {stats['image_frames_encoded_total']}.0" in metrics
    log = live.log_text()
    assert "Traceback" not in log and " 500 " not in log
