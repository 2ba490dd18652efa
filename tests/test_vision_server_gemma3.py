"""A tiny random Gemma 3 (scripts/tiny_vlm.py) served end to end: `python -m imp_jax.server` on loopback, the openai
client sending a picture (and two), each answer, its prompt token count and its first token's top logprobs checked
against transformers' Gemma3Processor (the chat template rendering the image item as `<start_of_image>`, the
processor expanding it) and greedy `generate` with its token_type_ids (image tokens attend both ways)."""
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from support.servers import LiveServer, openai_for, wait_idle  # noqa: E402
from support.vision import picture, served_checkpoint  # noqa: E402
from tiny_vlm import hf_gemma3_processor, write_tiny_gemma3  # noqa: E402  (scripts/, on sys.path above)

MAX_TOKENS = 8
GREEDY = dict(temperature=0.0, top_p=1.0)
GREEDY_EXTRA = dict(top_k=0, min_p=0.0, typical_p=1.0, repetition_penalty=1.0)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Any, Any]]:
    """The served checkpoint (prefill budget 32: prompts chunked around the images), transformers' model of it
    and its processor."""
    path = tmp_path_factory.mktemp("tiny-gemma3")
    model = write_tiny_gemma3(path)
    with served_checkpoint(path, 32, "--dtype", "float32") as live:
        yield live, model, hf_gemma3_processor(path)


def expected(vlm, question: str, pngs: list[bytes]) -> tuple[str, int, np.ndarray]:
    """transformers' greedy answer to one user turn (the question, then its pictures), its prompt's length and
    its five highest first-token logprobs."""
    _, model, processor = vlm
    content = [{"type": "text", "text": question}] + [{"type": "image"}] * len(pngs)
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    pics = [Image.open(io.BytesIO(p)).convert("RGB") for p in pngs]
    inputs = processor(text=[text], images=[pics], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=[1, 3],
                             pad_token_id=0)
        logits = model(**inputs).logits[0, -1]
    n = inputs["input_ids"].shape[1]
    top = torch.topk(torch.log_softmax(logits, -1), 5).values.numpy()
    return processor.tokenizer.decode(out[0, n:], skip_special_tokens=True), n, top


def chat_parts(question: str, pngs: list[bytes]) -> list[dict[str, Any]]:
    url = lambda p: "data:image/png;base64," + base64.b64encode(p).decode()
    return [{"type": "text", "text": question}, *({"type": "image_url", "image_url": {"url": url(p)}} for p in pngs)]


def test_openai_chat_with_pictures_answers_like_transformers(vlm) -> None:
    live = vlm[0]
    client = openai_for(live.url)
    a, b = picture(50, 37, seed=1), picture(30, 64, seed=2)
    for pngs in ([a], [a, b]):
        r = client.chat.completions.create(
            model=live.model, messages=[{"role": "user", "content": chat_parts("what is this?", pngs)}],
            max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=5, **GREEDY, extra_body=GREEDY_EXTRA)
        text, prompt_tokens, top = expected(vlm, "what is this?", pngs)
        assert r.usage.prompt_tokens == prompt_tokens and r.choices[0].message.content == text
        first = r.choices[0].logprobs.content[0]
        np.testing.assert_allclose(sorted((t.logprob for t in first.top_logprobs), reverse=True), top, atol=1e-4)
    assert httpx.get(live.url + "/props", timeout=30).json()["modalities"]["vision"] is True
    stats = wait_idle(live.url)
    assert stats.get("image_rows_used", 0) == 0
    log = live.log_text()
    assert "compiled image encoder" in log and "serving it as text" not in log and "Traceback" not in log
