"""Key limits through the real engine: the tiny SmolVLM of test_vision_engine.py served as if its family were
bidirectional (Gemma 3's rule: an image's tokens attend each other during prefill; `Idefics3Family.bidirectional`
set for this module), so the step program takes `key_limit` and the scheduler keeps each image in one chunk.
A prefill cut at the images gives what one whole chunk gives, and the key limits change the answer; an image
longer than the step's budget and CFG with images are 400s."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from support.idefics3 import config, pic, prompt, request, run  # noqa: E402
from imp_jax.errors import InvalidRequestError  # noqa: E402
from imp_jax.runtime.core.builder import build_engine  # noqa: E402
from imp_jax.runtime.features.images import ImagesFeature, image_bounds  # noqa: E402
from imp_jax.runtime.decoding.image_family import Idefics3Family  # noqa: E402
from imp_jax.runtime.request import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def engines(vlm):  # noqa: F811
    """(causal engine, bidirectional engine with a budget of 256, the same with 128: images then run whole in
    chunks of their own; its steps run one at a time, so that the test can count them: overlapped, a sequence's
    last step is followed by one more, launched before its end was read)."""
    causal = build_engine(config(vlm[0], 256))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Idefics3Family, "bidirectional", True)
        yield causal, build_engine(config(vlm[0], 256)), build_engine(config(vlm[0], 128, async_scheduling="off"))


def test_images_in_chunks_of_their_own_equal_one_chunk(engines):
    causal, whole, chunked = engines
    assert whole.step_fn.bidirectional_images and not causal.step_fn.bidirectional_images
    (a, _), (b, _) = pic("a"), pic("b")
    ids = prompt(a, b)
    family = whole.by_name["images"].family
    spans = image_bounds(request(ids, (a, b)), family)
    assert all(hi - lo <= 128 for lo, hi in spans) and any(lo < 128 < hi for lo, hi in spans)   # a cut
    want = run(whole, request(ids, (a, b), logprobs=5))[0]
    steps = chunked.num_steps
    got = run(chunked, dataclasses.replace(request(ids, (a, b), logprobs=5), speculative=False))[0]
    assert chunked.num_steps - steps == 3 + 5   # [0, 43) [43, 139) (image a) [139, 236) (b), then 5 decodes
    assert got["error"] is None and got["tokens"] == want["tokens"]
    np.testing.assert_allclose([x.logprob for x in got["logprobs"]], [x.logprob for x in want["logprobs"]],
                               atol=1e-4)
    plain = run(causal, request(ids, (a, b), logprobs=5))[0]
    first = lambda out: [out["logprobs"][0].logprob] + [lp for _, lp in out["logprobs"][0].top]   # noqa: E731
    assert np.abs(np.subtract(first(plain), first(want))).max() > 1e-3, "the key limits changed nothing"
    assert whole.stats()["compilations_after_warmup"] == 0 == chunked.stats()["compilations_after_warmup"]


def test_an_image_longer_than_the_budget_and_guidance_are_400s(engines):
    _, whole, _ = engines
    a, _ = pic("a")
    ids = prompt(a)
    small = dataclasses.replace(whole.services, config=dataclasses.replace(whole.config, max_num_batched_tokens=64),
                                step_fn=SimpleNamespace(mesh=None))   # a feature without an encoder
    with pytest.raises(InvalidRequestError, match="must run in one step") as e:
        ImagesFeature(small).check(request(ids, (a,)), SamplingParams())
    assert e.value.param == "images"
    guided = dataclasses.replace(request(ids, (a,)), cfg_scale=2.0, cfg_prompt_ids=[1, 2, 3])
    with pytest.raises(InvalidRequestError, match="cfg_scale") as e:
        whole.add_request(guided, lambda ev: None)
    assert e.value.param == "cfg_scale" and not whole.requests

