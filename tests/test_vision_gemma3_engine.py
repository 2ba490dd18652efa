"""The engine serving Gemma 3 images (runtime/decoding/image_family.py Gemma3Family: one frame of mm_tokens_per_image rows
per image, its tokens attending to each other both ways through the step's key limit) on the tiny random
checkpoint of test_vision_gemma3.py: greedy tokens and every token's logprobs equal transformers' `generate` with
its token_type_ids (the bidirectional image mask), with one and two pictures, in one chunk and chunked, and
everything back at baseline with no compilation after warm-up."""
from __future__ import annotations

import hashlib
import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from paged import run_to_end  # noqa: E402
from support.vision import hf_greedy_logprobs, synthetic_image  # noqa: E402
from imp_jax.runtime.core.builder import build_engine  # noqa: E402
from imp_jax.runtime.config import EngineConfig  # noqa: E402
from imp_jax.runtime.decoding.image_family import image_family  # noqa: E402
from imp_jax.runtime.request import GenerationRequest, ImageInput, SamplingParams  # noqa: E402

IMAGE = 6   # <image_soft_token> in scripts/tiny_vlm.py's Gemma 3 tokenizer
GREEDY = dict(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, max_tokens=8, ignore_eos=True)
SYSTEM = [0] + [10 + i % 40 for i in range(40)]   # 41 tokens: two full blocks before the first image
PICS = {"a": (37, 53, 0), "b": (64, 20, 1), "c": (53, 37, 2)}
_ids = itertools.count()


def image(width: int, height: int, seed: int) -> ImageInput:
    pixels = np.asarray(synthetic_image(width, height, seed))
    return ImageInput(pixels, hashlib.blake2b(pixels.tobytes() + bytes(str(pixels.shape), "ascii"),
                                              digest_size=16).digest(), "PNG", 0)


def prompt(core, *images: ImageInput, tail=(7, 8, 9)) -> list[int]:
    """SYSTEM, then each image's text (Engine.image_prompt's) and two tokens, then `tail`."""
    family = image_family(core.loaded.vision)
    ids = list(SYSTEM)
    for img in images:
        ids += core.tokenizer.encode(family.prompt(img.size), add_special_tokens=False) + [11, 12]
    return ids + list(tail)


def greedy(ids: list[int], images: tuple[ImageInput, ...], **params) -> GenerationRequest:
    return GenerationRequest(f"gimg-{next(_ids)}", ids, SamplingParams(**{**GREEDY, **params}), images=images)


def hf_greedy(tiny_gemma3, ids: list[int], specs: list[tuple[int, int, int]], n: int = 8) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens (`generate` with token_type_ids, EOS off) and its logprobs [n, vocab] at each
    of them, the latter from one forward pass over the prompt and the tokens (image tokens bidirectional)."""
    _, hf, processor, _ = tiny_gemma3
    pixels = (processor.image_processor(images=[synthetic_image(*s) for s in specs], return_tensors="pt")
              ["pixel_values"] if specs else None)

    def inputs(seq: list[int]) -> dict:
        out = dict(input_ids=torch.tensor([seq]))
        if pixels is not None:
            out.update(pixel_values=pixels, token_type_ids=(torch.tensor([seq]) == IMAGE).long())
        return out

    return hf_greedy_logprobs(hf, ids, inputs, n)


def config(path, budget: int) -> EngineConfig:
    return EngineConfig(model=str(path), max_model_len=256, max_num_seqs=4, max_num_batched_tokens=budget,
                        num_kv_blocks=96, image_cache_rows=16 * 8, seed=0, dtype="float32")


@pytest.fixture(scope="module")
def core(tiny_gemma3):
    return build_engine(config(tiny_gemma3[0], 256))


@pytest.fixture(scope="module")
def chunked_core(tiny_gemma3):
    """Budget 24 tokens: every image prompt's prefill is chunked, and a full chunk would end inside each image
    (tokens 43-58 and 65-80): the scheduler ends it before the image instead."""
    return build_engine(config(tiny_gemma3[0], 24))


def check_logprobs(got: dict, logprobs: np.ndarray) -> None:
    """Every generated token's logprob and top 5 within 1e-4 of transformers'."""
    assert len(got["logprobs"]) == len(logprobs)
    for lp, want in zip(got["logprobs"], logprobs):
        np.testing.assert_allclose([lp.logprob] + [x for _, x in lp.top],
                                   [want[lp.token_id]] + [want[t] for t, _ in lp.top], atol=1e-4)


@pytest.mark.parametrize("engine", ["core", "chunked_core"])
def test_greedy_with_one_and_two_images_matches_transformers(engine, tiny_gemma3, request):
    core = request.getfixturevalue(engine)
    (a, b) = (image(*PICS["a"]), image(*PICS["b"]))
    for imgs, specs in [((a,), [PICS["a"]]), ((a, b), [PICS["a"], PICS["b"]])]:
        ids = prompt(core, *imgs)
        assert ids.count(IMAGE) == 16 * len(imgs)
        got = run_to_end(core, greedy(ids, imgs, logprobs=5))[0]
        tokens, logprobs = hf_greedy(tiny_gemma3, ids, specs)
        assert got["error"] is None and got["tokens"] == tokens
        check_logprobs(got, logprobs)
    assert core.stats()["image_rows_used"] == 0 and core.pool.num_free_blocks == core.baseline_free_blocks


def test_the_key_limit_matters(core, tiny_gemma3):
    """transformers without token_type_ids (causal over the image) answers otherwise: the engine's match above
    is the bidirectional mask's, not a coincidence of the tiny model."""
    _, hf, processor, _ = tiny_gemma3
    a = image(*PICS["a"])
    ids = prompt(core, a)
    got = run_to_end(core, greedy(ids, (a,), logprobs=0))[0]
    pixels = processor.image_processor(images=[synthetic_image(*PICS["a"])], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        causal = torch.log_softmax(hf(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0, -1], -1).numpy()
    assert abs(got["logprobs"][0].logprob - causal[got["tokens"][0]]) > 1e-3


def test_same_picture_again_hits_the_row_and_prefix_caches(core):
    c = image(*PICS["c"])
    first = run_to_end(core, greedy(prompt(core, c), (c,)))[0]
    stats = core.stats()
    again = run_to_end(core, greedy(prompt(core, c), (c,)))[0]
    after = core.stats()
    assert again["tokens"] == first["tokens"] and again["usage"].cached_tokens >= 48
    assert after["image_frames_encoded_total"] == stats["image_frames_encoded_total"]


def test_no_compilation_after_warm_up(core, chunked_core):
    for c in (core, chunked_core):
        assert c.step_fn.warm and c.stats()["compilations_after_warmup"] == 0


def test_preempted_request_recomputes_the_same_tokens(chunked_core):
    """Preempted after its first image, its KV dropped: the recompute (chunks again ending before each image)
    gives the tokens and logprobs of an uninterrupted run, from the rows it kept."""
    a, b = image(45, 50, 11), image(50, 45, 12)
    ids = prompt(chunked_core, a, b, tail=(13, 14))
    want = run_to_end(chunked_core, greedy(ids, (a, b), logprobs=0))[0]
    r, out, logprobs = greedy(ids, (a, b), logprobs=0), [], []
    chunked_core.prepare(r)
    chunked_core.add_request(r, lambda ev: (out.extend(ev.token_ids), logprobs.extend(ev.logprobs or [])))
    seq = chunked_core.requests[r.request_id].seqs[0]
    while seq.num_computed < 60:   # past the first image
        chunked_core.step()
    frames = chunked_core.stats()["image_frames_encoded_total"]
    chunked_core.scheduler.preempt(seq)
    chunked_core.pool.reset_prefix_cache()
    while chunked_core.has_work():
        chunked_core.step()
    assert out == want["tokens"] and seq.num_preemptions == 1
    assert [x.logprob for x in logprobs] == pytest.approx([x.logprob for x in want["logprobs"]], abs=1e-5)
    assert chunked_core.stats()["image_frames_encoded_total"] == frames
    assert chunked_core.stats()["image_rows_used"] == 0
    assert chunked_core.pool.num_free_blocks == chunked_core.baseline_free_blocks
