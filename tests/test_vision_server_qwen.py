"""A tiny random Qwen2.5-VL (scripts/tiny_vlm.py) served end to end: `python -m imp_jax.server` on loopback, the
openai client sending one and two pictures, each answer checked against transformers' greedy `generate` on the
same checkpoint and prompt (the server's `<|vision_start|>` + pads + `<|vision_end|>` block per picture, the pads
counted from the picture's size as transformers' processor counts them); `/props` says vision."""
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
from support.servers import LiveServer, openai_for, wait_idle
from support.vision import picture, served_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiny_vlm import write_tiny_qwen2_5_vl  # noqa: E402  (scripts/, on sys.path above)
from imp_jax.model.vision import qwen2_5_vl_processor as proc  # noqa: E402

MAX_TOKENS = 8
GREEDY = dict(temperature=0.0, top_p=1.0)
GREEDY_EXTRA = dict(top_k=0, min_p=0.0, typical_p=1.0, repetition_penalty=1.0)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Any, Path]]:
    path = tmp_path_factory.mktemp("tiny-qwen2.5-vl")
    model = write_tiny_qwen2_5_vl(path)
    with served_checkpoint(path, 64, "--dtype", "float32") as live:
        yield live, model, path


def expected(vlm, question: str, pngs: list[bytes]) -> tuple[str, np.ndarray]:
    """transformers' greedy answer to one user turn (the question, then its pictures) rendered as the server does,
    and its five highest first-token logprobs (the tiny model's answers repeat one word: these see the pixels)."""
    _, model, path = vlm
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(path)
    cfg = proc.Qwen2VLProcessorConfig.from_hf(__import__("json").loads((path / "preprocessor_config.json").read_text()))
    pics = [Image.open(io.BytesIO(p)).convert("RGB") for p in pngs]
    pre = proc.preprocess(pics, cfg)
    blocks = "".join(proc.image_prompt(g, cfg.merge_size) for g in pre.image_grid_thw)
    ids = tokenizer(f"<|im_start|>user\n{question}{blocks}<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    image_id = model.config.image_token_id
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), pixel_values=torch.tensor(pre.pixel_values),
                             image_grid_thw=torch.tensor(pre.image_grid_thw),
                             mm_token_type_ids=(torch.tensor([ids]) == image_id).int(), max_new_tokens=MAX_TOKENS,
                             do_sample=False, eos_token_id=[1, 3], pad_token_id=0)
        logits = model(input_ids=torch.tensor([ids]), pixel_values=torch.tensor(pre.pixel_values),
                       image_grid_thw=torch.tensor(pre.image_grid_thw),
                       mm_token_type_ids=(torch.tensor([ids]) == image_id).int()).logits[0, -1]
    top = torch.topk(torch.log_softmax(logits, -1), 5).values.numpy()
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True), top


def chat_parts(question: str, pngs: list[bytes]) -> list[dict[str, Any]]:
    url = lambda p: "data:image/png;base64," + base64.b64encode(p).decode()
    return [{"type": "text", "text": question}, *({"type": "image_url", "image_url": {"url": url(p)}} for p in pngs)]


def test_openai_chat_with_one_and_two_pictures_answers_like_transformers(vlm) -> None:
    live = vlm[0]
    client = openai_for(live.url)
    a, b = picture(50, 37, seed=1), picture(30, 64, seed=2)
    for pngs in ([a], [a, b]):
        r = client.chat.completions.create(
            model=live.model, messages=[{"role": "user", "content": chat_parts("what is this?", pngs)}],
            max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=5, **GREEDY, extra_body=GREEDY_EXTRA)
        text, top = expected(vlm, "what is this?", pngs)
        assert r.choices[0].message.content == text
        first = r.choices[0].logprobs.content[0]
        np.testing.assert_allclose(sorted((t.logprob for t in first.top_logprobs), reverse=True), top, atol=1e-4)
    again = client.chat.completions.create(
        model=live.model, messages=[{"role": "user", "content": chat_parts("what is this?", [a])}],
        max_tokens=MAX_TOKENS, **GREEDY, extra_body=GREEDY_EXTRA)
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 16
    assert httpx.get(live.url + "/props", timeout=30).json()["modalities"]["vision"] is True
    stats = wait_idle(live.url)
    assert stats.get("image_rows_used", 0) == 0
    assert "compiled image encoder" in live.log_text() and "serving it as text" not in live.log_text()
