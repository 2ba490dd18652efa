"""The engine serving images (runtime/features/images.py) on a tiny random SmolVLM written by transformers:
greedy output equals transformers' `generate` with the same pictures, the row pool and the prefix cache key
on the image, chunked prefill across an image, failures and refusals, and everything back at baseline."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from support.idefics3 import SYSTEM, config, image, layout_ids, pic, prompt, request, run  # noqa: E402
from support.vision import synthetic_image  # noqa: E402
from imp_jax.errors import EngineError, InvalidRequestError, ModelLoadError  # noqa: E402
from imp_jax.model.formats.loader import open_checkpoint  # noqa: E402
from imp_jax.model.vision import idefics3_processor as proc  # noqa: E402
from imp_jax.runtime.core.async_engine import AsyncEngine  # noqa: E402
from imp_jax.runtime.core.builder import build_engine, tensor_parallel_layout  # noqa: E402
from imp_jax.runtime.config import EngineConfig  # noqa: E402
from imp_jax.runtime.features import Services  # noqa: E402
from imp_jax.runtime.features.images import ImagesFeature  # noqa: E402
from imp_jax.runtime.scheduling.image_rows import ImageRows  # noqa: E402
from imp_jax.runtime.kv.kv_hash import ImageKeys, block_key, durable_key, prefix_hashes  # noqa: E402
from imp_jax.runtime.request import SamplingParams  # noqa: E402



def hf_greedy(hf, ids: list[int], images: list[tuple[int, int, int]]) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens and its logprobs at the last prompt token, for the same pictures."""
    pre = proc.preprocess([synthetic_image(*spec) for spec in images],
                          proc.ImageProcessorConfig.from_hf(dict(size={"longest_edge": 64},
                                                                 max_image_size={"longest_edge": 32})))
    inputs = dict(input_ids=torch.tensor([ids]), pixel_values=torch.tensor(pre.pixel_values[None]),
                  pixel_attention_mask=torch.tensor(pre.pixel_attention_mask[None]))
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=0)
        logits = hf(**inputs).logits[0, -1]
    return out[0, len(ids):].tolist(), torch.log_softmax(logits, -1).numpy()


@pytest.fixture(scope="module")
def core(vlm):
    return build_engine(config(vlm[0], 256))


@pytest.fixture(scope="module")
def chunked_core(vlm):
    return build_engine(config(vlm[0], 32))


def test_greedy_with_images_matches_transformers(core, vlm):
    (a, a_ref), (b, b_ref) = pic("a"), pic("b")
    for imgs, refs in [((a,), [a_ref]), ((a, b), [a_ref, b_ref])]:
        ids = prompt(*imgs)
        got = run(core, request(ids, imgs, logprobs=5))[0]
        tokens, logprobs = hf_greedy(vlm[1], ids, refs)
        assert got["error"] is None and got["tokens"] == tokens
        first = got["logprobs"][0]   # the image rows reach the logits (without them: off by ~0.3)
        np.testing.assert_allclose([first.logprob] + [lp for _, lp in first.top],
                                   [logprobs[first.token_id]] + [logprobs[t] for t, _ in first.top], atol=1e-4)


def test_same_text_different_pictures_share_only_the_text_prefix(core):
    (a, _), (c, _) = pic("a"), pic("c")
    first = run(core, request(prompt(a), (a,), logprobs=0))[0]
    other = run(core, request(prompt(c), (c,), logprobs=0))[0]
    assert prompt(a) == prompt(c)   # the same token ids: only the pixels differ
    assert other["logprobs"][0].logprob != first["logprobs"][0].logprob
    assert other["usage"].cached_tokens == 32   # the two blocks before the image, no block of it
    stats = core.stats()
    again = run(core, request(prompt(a), (a,), logprobs=0))[0]
    after = core.stats()
    assert again["tokens"] == first["tokens"] and again["usage"].cached_tokens > 32 + 16 * 5
    assert after["image_row_cache_hits_total"] == stats["image_row_cache_hits_total"] + 1
    assert after["image_frames_encoded_total"] == stats["image_frames_encoded_total"]


def test_two_image_requests_in_one_step_each_as_alone(core):
    (a, _), (b, _) = pic("a"), pic("b")
    alone = [run(core, request(prompt(x, tail=(11, 12)), (x,)))[0]["tokens"] for x in (a, b)]
    launches = core.stats()["image_encoder_launches_total"]
    both = run(core, request(prompt(a, tail=(11, 12)), (a,), n=2), request(prompt(b, tail=(11, 12)), (b,)))
    assert [both[0]["choices"][0], both[0]["choices"][1], both[1]["tokens"]] == [alone[0], alone[0], alone[1]]
    assert core.stats()["image_encoder_launches_total"] == launches   # both rows cached: nothing encoded


def test_chunked_prefill_across_an_image_equals_one_chunk(core, chunked_core):
    (a, _), (b, _) = pic("a"), pic("b")
    ids = prompt(a, b)
    assert run(chunked_core, request(ids, (a, b)))[0]["tokens"] == run(core, request(ids, (a, b)))[0]["tokens"]


def test_async_scheduling_gives_the_same_tokens(vlm, chunked_core):
    """Steps launched before the previous one is read (the accelerators' default): an encoder launch donates
    the pool while a step reading it may still run."""
    async_core = build_engine(config(vlm[0], 32, async_scheduling="on"))
    a, b = image(41, 47, 21), image(47, 41, 22)
    reqs = lambda: [request(prompt(a, b, tail=(15,)), (a, b)), request(prompt(b, tail=(16,)), (b,))]
    assert [o["tokens"] for o in run(async_core, *reqs())] == [o["tokens"] for o in run(chunked_core, *reqs())]
    assert async_core.counters.overlapped_steps > 0 and async_core.stats()["compilations_after_warmup"] == 0


def test_structured_output_and_speculation_with_an_image(core):
    """A grammar constrains the answer to an image prompt; a drafting request (speculative: images only in
    the prompt) gives the tokens it gives without drafting."""
    import llguidance

    a, _ = pic("a")
    r = request(prompt(a), (a,), max_tokens=8, ignore_eos=False)
    r.constraint = llguidance.LLMatcher.grammar_from_regex(r"(yes|no), [0-9]{2}")
    out = run(core, r)[0]
    assert out["error"] is None and re.fullmatch(r"(yes|no), [0-9]{2}", core.tokenizer.decode(out["tokens"]))
    ids = prompt(a, tail=tuple(range(20, 30)) * 3)   # a repetitive tail: something to draft from
    plain = run(core, dataclasses.replace(request(ids, (a,), max_tokens=16), speculative=False))[0]
    before = core.counters.spec_drafted
    drafted = run(core, dataclasses.replace(request(ids, (a,), max_tokens=16), speculative=True))[0]
    assert drafted["tokens"] == plain["tokens"] and core.counters.spec_drafted > before


def test_encoder_launches_images_of_several_requests_at_once(core):
    feature = core.by_name["images"]
    a, c = image(40, 61, 7), image(61, 40, 8)
    before = feature.encoder.launches
    run(core, request(prompt(a, tail=()), (a,)), request(prompt(c, tail=()), (c,)), prepare=False)
    assert feature.encoder.launches == before + 1


def test_no_compilation_after_warm_up(core, chunked_core):
    for c in (core, chunked_core):
        assert c.step_fn.warm and c.stats()["compilations_after_warmup"] == 0


def test_an_encoder_failure_fails_only_its_request(chunked_core, monkeypatch):
    feature = chunked_core.by_name["images"]
    d = image(33, 33, 9)
    monkeypatch.setattr(feature.encoder, "_run", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    bad, text = run(chunked_core, request(prompt(d), (d,)), request(SYSTEM + [7, 8], ()))
    assert bad["error"] and len(text["tokens"]) == 6 and text["error"] is None
    monkeypatch.undo()
    ok = run(chunked_core, request(prompt(d), (d,)))[0]   # encoded afresh, not served the failed KV
    assert ok["error"] is None and ok["usage"].cached_tokens <= 32


def test_image_token_count_mismatch_and_text_only_model_are_clean_400s(core):
    (a, _), (b, _) = pic("a"), pic("b")
    with pytest.raises(InvalidRequestError, match=r"the prompt has \d+ image tokens, but its 2 image") as e:
        core.add_request(request(prompt(a), (a, b)), lambda ev: None)
    assert e.value.param == "images"
    with pytest.raises(InvalidRequestError, match="but its 0 image"):   # image tokens with no image
        core.add_request(request(prompt(a), ()), lambda ev: None)
    text_only = ImagesFeature(Services(*[None] * 10))
    with pytest.raises(InvalidRequestError, match="no image input") as e:
        text_only.check(request(prompt(a), (a,)), SamplingParams())
    assert e.value.param == "images" and not core.requests


def test_preempted_request_recomputes_from_the_same_rows(chunked_core):
    a, b = image(45, 50, 11), image(50, 45, 12)   # new pictures: an image whose KV is all cached is never encoded
    ids = prompt(a, b, tail=(13, 14))
    want = run(chunked_core, request(ids, (a, b), logprobs=0))[0]
    r, out, logprobs = request(ids, (a, b), logprobs=0), [], []
    chunked_core.prepare(r)
    chunked_core.add_request(r, lambda ev: (out.extend(ev.token_ids), logprobs.extend(ev.logprobs or [])))
    seq = chunked_core.requests[r.request_id].seqs[0]
    while seq.num_computed < len(ids) - 20:   # inside the second image
        chunked_core.step()
    frames = chunked_core.stats()["image_frames_encoded_total"]
    chunked_core.scheduler.preempt(seq)
    chunked_core.pool.reset_prefix_cache()   # recompute every token, the images' included
    while chunked_core.has_work():
        chunked_core.step()
    assert out == want["tokens"] and seq.num_preemptions == 1
    assert [x.logprob for x in logprobs] == pytest.approx([x.logprob for x in want["logprobs"]], abs=1e-5)
    assert chunked_core.stats()["image_frames_encoded_total"] == frames   # the rows were kept, not re-encoded
    assert chunked_core.stats()["image_rows_used"] == 0
    assert chunked_core.pool.num_free_blocks == chunked_core.baseline_free_blocks


def test_async_engine_streams_an_image_request(core):
    """Through the AsyncEngine (prepare on a worker thread, streaming): `vision`, `image_prompt` and the tokens
    the core gives."""
    (a, _), (b, _) = pic("a"), pic("b")
    want = run(core, request(prompt(a), (a,)))[0]["tokens"]

    async def main() -> list[int]:
        engine = AsyncEngine(core.config, build=lambda config, progress: core)
        engine.start()
        try:
            await engine.wait_ready()
            assert engine.vision and layout_ids(engine.image_prompt(a)) == prompt(a)[len(SYSTEM):-5]
            with pytest.raises(InvalidRequestError):
                [ev async for ev in engine.generate(request(prompt(a), (a, b)))]
            tokens = [t async for ev in engine.generate(request(prompt(a), (a,))) for t in ev.token_ids]
            key = engine.prefix_key(request(prompt(a), (a,)))   # data-parallel routing finds the image's blocks
            assert isinstance(key, ImageKeys) and all(map(engine.holds_block, prefix_hashes(prompt(a), 16, key)))
            return tokens
        finally:
            engine.shutdown()

    assert asyncio.run(main()) == want
    assert core.pool.num_free_blocks == core.baseline_free_blocks and core.stats()["image_rows_used"] == 0


def test_a_cancelled_image_request_gives_back_its_blocks_and_rows(chunked_core):
    a = image(44, 52, 31)
    r = request(prompt(a), (a,))
    chunked_core.prepare(r)
    chunked_core.add_request(r, lambda ev: None)
    for _ in range(3):   # into the image: its rows encoded and in use
        chunked_core.step()
    assert chunked_core.stats()["image_rows_used"] == 5 * 16
    chunked_core.cancel(r.request_id)
    assert not chunked_core.requests and chunked_core.stats()["image_rows_used"] == 0
    assert chunked_core.pool.num_free_blocks == chunked_core.baseline_free_blocks


def test_images_held_by_running_requests_make_a_retryable_503(chunked_core):
    a, b, c = image(36, 50, 41), image(50, 36, 42), image(40, 40, 43)   # 5 frames each; the pool holds 12
    holder = request(prompt(a, b), (a, b))
    chunked_core.add_request(holder, lambda ev: None)
    with pytest.raises(EngineError) as e:
        chunked_core.add_request(request(prompt(c), (c,)), lambda ev: None)
    assert e.value.code == "image_cache_full" and e.value.status == 503
    chunked_core.cancel(holder.request_id)
    assert not chunked_core.requests and chunked_core.stats()["image_rows_used"] == 0
    assert chunked_core.pool.num_free_blocks == chunked_core.baseline_free_blocks


def test_every_tier_hashes_image_blocks_alike():
    """The pool's committed hashes are the chain the host and disk tiers and the replica router compute
    (kv_hash.prefix_hashes), and an image block's preimage may go to disk."""
    from imp_jax.runtime.kv.kv_blocks import BlockTable, KVBlockPool
    from imp_jax.runtime.kv.kv_hash import durable_preimage
    ids, keys = list(range(80)), ImageKeys("salt", ((20, 50, "ab" * 16),))
    pool, table = KVBlockPool(16, 16), BlockTable()
    assert pool.allocate(table, ids, len(ids), keys)
    pool.commit(table, ids, keys)
    assert table.block_hashes[:4] == list(prefix_hashes(ids, 16, keys))
    assert table.block_hashes[0] == next(prefix_hashes(ids, 16, "salt"))   # before the image: the plain key
    assert table.block_hashes[1] != next(itertools.islice(prefix_hashes(ids, 16, "salt"), 1, None))
    assert all(durable_preimage(pool._preimage[b]) for b in table.block_ids[:5])


def test_image_keys_vary_by_block_and_stay_durable():
    keys = ImageKeys("salt", ((20, 40, "aa"), (50, 60, "bb")))
    assert block_key(keys, 0, 16) == "salt" and block_key(keys, 16, 32) == ("salt", "images", "aa")
    assert block_key(keys, 32, 48) == ("salt", "images", "aa") and block_key(keys, 48, 64) == ("salt", "images", "bb")
    assert durable_key(block_key(keys, 32, 48)) and not durable_key((("private", "x", None), "images", "aa"))


def test_row_pool_refcounts_caches_and_evicts_least_recently_used():
    rows = ImageRows(num_slots=5, rows_per_frame=4)
    a, b = rows.acquire([(b"a", 2), (b"b", 2)])
    assert rows.acquire([(b"c", 2)]) is None and rows.slots_in_use == 4   # all or nothing
    a.encoded = b.encoded = True
    rows.release([a])
    rows.release([b])
    assert rows.slots_in_use == 0 and rows.acquire([(b"a", 2)])[0] is a and rows.hits == 1
    (c,) = rows.acquire([(b"c", 3)])   # evicts b (unused), keeps a (held)
    assert rows.acquire([(b"b", 2)]) is None and rows.rows(a) == [s * 4 + r for s in a.slots for r in range(4)]
    rows.release([c])   # never encoded: freed, not cached
    assert rows.num_free_slots == 3


def test_tensor_parallel_with_vision_is_refused_at_start_up(vlm):
    with pytest.raises(ModelLoadError, match="image-text models do not run tensor-parallel"):
        tensor_parallel_layout(EngineConfig(model=str(vlm[0]), tensor_parallel_size=2), open_checkpoint(str(vlm[0])))


def test_config_refuses_a_row_pool_of_nothing():
    with pytest.raises(ValueError, match="image-cache-rows"):
        dataclasses.replace(EngineConfig(), image_cache_rows=0)
