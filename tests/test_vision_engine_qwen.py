"""The engine serving Qwen2.5-VL images (runtime/decoding/image_family.py, image_encoder_qwen.py, M-RoPE positions in
the step) on the tiny random checkpoint of test_vision_qwen2_5_vl.py: greedy tokens and first-token logprobs
equal transformers' `generate` with one and two pictures of different sizes, through chunked prefill across
the images, the text after them (decode at index + delta), the row and prefix caches, preemption,
speculation, and everything back at baseline with no compilation after warm-up."""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from paged import run_to_end  # noqa: E402
from support.qwen_vl import END, IMAGE, START  # noqa: E402
from support.vision import hf_greedy_logprobs, synthetic_image  # noqa: E402
from imp_jax.model.vision import qwen2_5_vl_processor as proc  # noqa: E402
from imp_jax.runtime.core.async_engine import AsyncEngine  # noqa: E402
from imp_jax.runtime.core.builder import build_engine  # noqa: E402
from imp_jax.runtime.config import EngineConfig  # noqa: E402
from imp_jax.runtime.kv.kv_hash import ImageKeys  # noqa: E402
from imp_jax.runtime.request import GenerationRequest, ImageInput, SamplingParams  # noqa: E402

GREEDY = dict(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, max_tokens=8, ignore_eos=True)
SYSTEM = [0] + [10 + i % 40 for i in range(40)]   # 41 tokens: two full blocks before the first image
PICS = {"a": (37, 53, 0), "b": (64, 64, 1), "c": (53, 37, 2)}   # 35, 36 and 35 rows
_ids = itertools.count()


def image(width: int, height: int, seed: int) -> ImageInput:
    pixels = np.asarray(synthetic_image(width, height, seed))
    return ImageInput(pixels, hashlib.blake2b(pixels.tobytes() + bytes(str(pixels.shape), "ascii"),
                                              digest_size=16).digest(), "PNG", 0)


def rows(core, img: ImageInput) -> int:
    vision = core.loaded.vision
    return vision.config.rows(proc.image_grid(*img.size, vision.processor))


def prompt(core, *images: ImageInput, tail=(7, 8, 9)) -> list[int]:
    ids = list(SYSTEM)
    for img in images:
        ids += [START] + [IMAGE] * rows(core, img) + [END, 5, 6]
    return ids + list(tail)


def request(ids: list[int], images: tuple[ImageInput, ...], **params) -> GenerationRequest:
    return GenerationRequest(f"qimg-{next(_ids)}", ids, SamplingParams(**{**GREEDY, **params}), images=images)


def run(core, *reqs: GenerationRequest) -> list[dict]:
    """Run the requests together to the end (paged.run_to_end: pools back at their baselines)."""
    return run_to_end(core, *reqs)


def hf_greedy(hf, ids: list[int], sizes: list[tuple[int, int, int]], vision, n: int = 8):
    """transformers' greedy tokens (`generate`, EOS off) and its logprobs [n, vocab] at each of them, the latter
    from one forward pass over the prompt and the tokens (generate's own logits drift ~1e-3 from its forward)."""
    pre = proc.preprocess([synthetic_image(*spec) for spec in sizes], vision.processor) if sizes else None

    def inputs(seq: list[int]) -> dict:
        out = dict(input_ids=torch.tensor([seq]))
        if pre is not None:
            out.update(pixel_values=torch.tensor(pre.pixel_values), image_grid_thw=torch.tensor(pre.image_grid_thw),
                       mm_token_type_ids=(torch.tensor([seq]) == IMAGE).int())
        return out

    return hf_greedy_logprobs(hf, ids, inputs, n)


@pytest.fixture(scope="module")
def core(tiny_qwen):
    """Budget 32 tokens: every image prompt's prefill is chunked, chunk edges inside the images."""
    return build_engine(EngineConfig(model=str(tiny_qwen[0]), max_model_len=256, max_num_seqs=4,
                                     max_num_batched_tokens=32, num_kv_blocks=96, image_cache_rows=16 * 12,
                                     seed=0, dtype="float32"))


def pic(name: str) -> tuple[ImageInput, tuple[int, int, int]]:
    return image(*PICS[name]), PICS[name]


def check_logprobs(got: dict, logprobs: np.ndarray) -> None:
    """Every generated token's logprob and top 5 within 1e-4 of transformers' (the first: the images reach the
    logits; the rest: the decode positions, index + delta)."""
    assert len(got["logprobs"]) == len(logprobs)
    for lp, want in zip(got["logprobs"], logprobs):
        np.testing.assert_allclose([lp.logprob] + [x for _, x in lp.top],
                                   [want[lp.token_id]] + [want[t] for t, _ in lp.top], atol=1e-4)


def test_greedy_with_one_and_two_images_matches_transformers(core, tiny_qwen):
    """Eight tokens after the images: the decode positions (index + delta) and the chunked prefill's [3, T]."""
    (a, a_ref), (b, b_ref) = pic("a"), pic("b")
    assert rows(core, a) != rows(core, b)
    for imgs, refs in [((a,), [a_ref]), ((a, b), [a_ref, b_ref])]:
        ids = prompt(core, *imgs)
        got = run(core, request(ids, imgs, logprobs=5))[0]
        tokens, logprobs = hf_greedy(tiny_qwen[1], ids, refs, core.loaded.vision)
        assert got["error"] is None and got["tokens"] == tokens
        check_logprobs(got, logprobs)


def test_text_only_request_matches_transformers(core, tiny_qwen):
    ids = SYSTEM + [7, 8, 9, 11]
    got = run(core, request(ids, (), logprobs=5))[0]
    tokens, logprobs = hf_greedy(tiny_qwen[1], ids, [], core.loaded.vision)
    assert got["tokens"] == tokens
    check_logprobs(got, logprobs)


def test_same_picture_again_hits_the_row_and_prefix_caches(core):
    (a, _), (c, _) = pic("a"), pic("c")
    first = run(core, request(prompt(core, a), (a,), logprobs=0))[0]
    other = run(core, request(prompt(core, c), (c,), logprobs=0))[0]
    assert prompt(core, a) == prompt(core, c)   # the same token ids: only the pixels differ
    assert other["logprobs"][0].logprob != first["logprobs"][0].logprob
    assert other["usage"].cached_tokens == 32   # the two blocks before the image, no block of it
    stats = core.stats()
    again = run(core, request(prompt(core, a), (a,), logprobs=0))[0]
    after = core.stats()
    full_blocks = len(prompt(core, a)) // 16 * 16   # through the image: every full block
    assert again["tokens"] == first["tokens"] and again["usage"].cached_tokens == full_blocks > 42 + 35
    assert [x.logprob for x in again["logprobs"]] == pytest.approx([x.logprob for x in first["logprobs"]], abs=1e-5)
    assert after["image_row_cache_hits_total"] == stats["image_row_cache_hits_total"] + 1
    assert after["image_frames_encoded_total"] == stats["image_frames_encoded_total"]


def test_two_image_requests_in_one_step_each_as_alone(core):
    a, b = image(41, 47, 21), image(47, 41, 22)
    alone = [run(core, request(prompt(core, x, tail=(11, 12)), (x,)))[0]["tokens"] for x in (a, b)]
    both = run(core, request(prompt(core, a, tail=(11, 12)), (a,), n=2),
               request(prompt(core, b, tail=(11, 12)), (b,)))
    assert [both[0]["choices"][0], both[0]["choices"][1], both[1]["tokens"]] == [alone[0], alone[0], alone[1]]


def test_preempted_request_recomputes_the_same_positions(core):
    a, b = image(45, 50, 11), image(50, 45, 12)
    ids = prompt(core, a, b, tail=(13, 14))
    want = run(core, request(ids, (a, b), logprobs=0))[0]
    r, out, logprobs = request(ids, (a, b), logprobs=0), [], []
    core.prepare(r)
    core.add_request(r, lambda ev: (out.extend(ev.token_ids), logprobs.extend(ev.logprobs or [])))
    seq = core.requests[r.request_id].seqs[0]
    while len(seq.output_ids) < 3:   # decoding, past the images
        core.step()
    core.scheduler.preempt(seq)
    core.pool.reset_prefix_cache()   # recompute every token: the prompt's [3, T] and the output's index + delta
    while core.has_work():
        core.step()
    assert out == want["tokens"] and seq.num_preemptions == 1
    assert [x.logprob for x in logprobs] == pytest.approx([x.logprob for x in want["logprobs"]], abs=1e-5)
    assert core.stats()["image_rows_used"] == 0 and core.pool.num_free_blocks == core.baseline_free_blocks


def test_speculation_after_an_image_gives_the_same_tokens(core):
    a, _ = pic("a")
    ids = prompt(core, a, tail=tuple(range(20, 30)) * 3)   # a repetitive tail: something to draft from
    plain = run(core, dataclasses.replace(request(ids, (a,), max_tokens=16), speculative=False))[0]
    before = core.counters.spec_drafted
    drafted = run(core, dataclasses.replace(request(ids, (a,), max_tokens=16), speculative=True))[0]
    assert drafted["tokens"] == plain["tokens"] and core.counters.spec_drafted > before


def test_async_scheduling_gives_the_same_tokens(tiny_qwen, core):
    """Steps launched before the previous one is read: the pending token's row gets its position all the same."""
    async_core = build_engine(dataclasses.replace(core.config, async_scheduling="on"))
    a, b = image(41, 47, 31), image(47, 41, 32)
    reqs = lambda: [request(prompt(core, a, b, tail=(15,)), (a, b)), request(prompt(core, b, tail=(16,)), (b,))]
    assert [o["tokens"] for o in run(async_core, *reqs())] == [o["tokens"] for o in run(core, *reqs())]
    assert async_core.counters.overlapped_steps > 0 and async_core.stats()["compilations_after_warmup"] == 0


def test_async_engine_image_prompt_and_prefix_key(core):
    (a, _), (b, _) = pic("a"), pic("b")

    async def main() -> None:
        engine = AsyncEngine(core.config, build=lambda config, progress: core)
        engine.start()
        try:
            await engine.wait_ready()
            text = engine.image_prompt(b)
            assert engine.vision and text == (proc.VISION_START + proc.IMAGE_TOKEN * rows(core, b)
                                              + proc.VISION_END)
            key = engine.prefix_key(request(prompt(core, a), (a,)))
            assert isinstance(key, ImageKeys) and key.spans == ((42, 42 + rows(core, a), a.digest.hex()),)
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_bad_image_runs_are_clean_400s_and_nothing_compiles_after_warm_up(core):
    from imp_jax.errors import InvalidRequestError

    a, b = pic("a")[0], pic("b")[0]
    ids = prompt(core, a, b)
    n = rows(core, a)
    joined = ids[:42 + n] + ids[42 + n + 4:]   # no END, 5, 6, START: b's pads follow a's, one run of both
    assert joined.count(IMAGE) == ids.count(IMAGE)
    with pytest.raises(InvalidRequestError, match="one run of exactly its count"):
        core.add_request(request(joined, (a, b)), lambda ev: None)
    assert not core.requests
    long = image(2000, 10, 5)   # resized to 8 x 672 pixels: past the largest bucket (transformers takes it)
    with pytest.raises(InvalidRequestError, match="patches; the encoder takes at most 256") as e:
        core.add_request(request(prompt(core, long), (long,)), lambda ev: None)
    assert e.value.param == "images" and not core.requests
    encoder = core.by_name["images"].encoder
    assert len(encoder.buckets) > 1 and core.step_fn.mrope
    assert core.step_fn.warm and core.stats()["compilations_after_warmup"] == 0
    assert core.stats()["image_encoder_launches_total"] > 0


def test_encoder_rows_in_the_pool_equal_the_eager_tower(core):
    """Through the engine (chunked: each image encoded when a chunk first reaches it), each image's rows land
    where the row pool says; launched directly, images past the largest bucket (a full 12 x 12 grid is 144
    patches: 256 hold one) go one launch each and a small one shares a launch."""
    import jax.numpy as jnp

    feature, vision = core.by_name["images"], core.loaded.vision
    imgs = (image(64, 64, 41), image(48, 48, 42), image(47, 49, 43), image(9, 9, 44))
    run(core, request(prompt(core, *imgs, tail=(3,)), imgs, max_tokens=1))
    pool = np.asarray(core.step_fn.image_pool)
    pixels = [feature.family.pixels(img.pixels) for img in imgs]
    want = [vision.encoder.encode(px.patches, [px.grid]) for px in pixels]
    for img, rows_ in zip(imgs, want):
        entry = feature.rows._idle[img.digest]   # cached after the request
        np.testing.assert_allclose(pool[feature.rows.rows(entry)[:entry.num_rows]], rows_, atol=1e-5)
    owner = type("Owner", (), {})()
    owner.image_pool = jnp.zeros_like(core.step_fn.image_pool)
    encoder, launches = feature.encoder, feature.encoder.launches
    dests = [np.arange(40 * i, 40 * i + len(w)) for i, w in enumerate(want)]
    encoder.encode(owner, pixels, dests)
    assert encoder.launches == launches + 3 and [len(px.patches) for px in pixels] == [144, 144, 144, 16]
    got = np.asarray(owner.image_pool)
    for d, rows_ in zip(dests, want):
        np.testing.assert_allclose(got[d], rows_, atol=1e-5)
