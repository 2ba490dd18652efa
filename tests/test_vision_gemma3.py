"""Gemma 3's image side (model/vision/gemma3*.py) against transformers on a tiny random
Gemma3ForConditionalGeneration (scripts/tiny_vlm.py): the SigLIP tower + multimodal projector's rows, the
preprocessor's frames, the image's prompt text and the chat route's prompt ids, the loader, and a whole prompt's
logits with images spliced in (their rows unscaled over the scaled text embeddings)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from support.vision import synthetic_image  # noqa: E402
from tiny_vlm import GEMMA_PRE, GEMMA_TOKENS  # noqa: E402
from imp_jax.errors import ModelLoadError  # noqa: E402
from imp_jax.kernels_pallas import AttentionMetadata  # noqa: E402
from imp_jax.model.formats.loader import load_model, open_checkpoint  # noqa: E402
from imp_jax.model.vision import gemma3_processor as proc  # noqa: E402
from imp_jax.model.vision.gemma3 import Gemma3Vision  # noqa: E402
from imp_jax.runtime.execution.batch import SeqChunk, build_step_batch  # noqa: E402
from imp_jax.runtime.decoding.image_family import Gemma3Family, family_class, image_family  # noqa: E402
from imp_jax.runtime.request import ImageInput  # noqa: E402
from imp_jax.runtime.execution.step_programs import model_forward  # noqa: E402
from imp_jax.server.image_prompts import PromptImages, count_marks, expand, image_mark  # noqa: E402

SIZES = [(37, 53), (32, 32), (200, 90), (20, 300), (7, 5)]   # PIL (width, height): down, same, up, elongated


def hf_rows(hf, pixels: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf.model.get_image_features(torch.tensor(pixels)).pooler_output.numpy()


def test_tower_and_projector_match_transformers(tiny_gemma3):
    _, hf, _, loaded = tiny_gemma3
    pixels = np.random.default_rng(0).normal(size=(3, 3, 32, 32)).astype(np.float32)
    forward = nnx.jit(lambda m, p, pm: m(p, pm))
    ours = np.asarray(forward(loaded.vision.encoder, jnp.asarray(pixels), jnp.ones((3, 8, 8), bool)))
    want = hf_rows(hf, pixels)
    assert ours.shape == want.shape == (3, GEMMA_TOKENS, 64)
    np.testing.assert_allclose(ours, want, atol=1e-5, rtol=0)


def test_the_hubs_tensor_names_load_the_same_image_side(tiny_gemma3, tmp_path):
    """google/gemma-3-*'s safetensors keep the tower under `vision_tower.vision_model.*` (transformers 5 saves
    `vision_tower.*`): either loads."""
    from safetensors.numpy import load_file, save_file

    path, _, _, loaded = tiny_gemma3
    tensors = load_file(path / "model.safetensors")
    save_file({k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in tensors.items()},
              tmp_path / "model.safetensors")
    for f in path.iterdir():
        if f.suffix == ".json":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    hub = load_model(tmp_path, dtype="float32")
    pixels = jnp.asarray(np.random.default_rng(1).normal(size=(1, 3, 32, 32)).astype(np.float32))
    mask = jnp.ones((1, 8, 8), bool)
    np.testing.assert_array_equal(np.asarray(hub.vision.encoder(pixels, mask)),
                                  np.asarray(loaded.vision.encoder(pixels, mask)))


def test_loader_exposes_the_gemma3_family(tiny_gemma3):
    path, _, _, loaded = tiny_gemma3
    v = loaded.vision
    assert isinstance(v.encoder, Gemma3Vision) and v.family == "gemma3"
    # the opened checkpoint already says so: the builder's kernel self-test then checks key limits
    assert family_class(open_checkpoint(path).vision) is Gemma3Family
    assert (v.config.image_seq_len, v.config.image_token_id, v.config.pool, v.processor.size) == (16, 6, 2, 32)
    family = image_family(v)
    assert isinstance(family, Gemma3Family) and family.bidirectional
    assert [family.units(s) for s in SIZES] == [1] * len(SIZES) and family.num_rows((300, 20)) == 16


@pytest.mark.parametrize("size", SIZES)
def test_preprocessor_matches_transformers(tiny_gemma3, size):
    processor = tiny_gemma3[2]
    image = synthetic_image(*size, seed=size[0])
    want = processor.image_processor(images=[image], return_tensors="np")["pixel_values"][0]
    cfg = proc.Gemma3ProcessorConfig.from_hf(GEMMA_PRE, 32)
    np.testing.assert_allclose(proc.preprocess(image, cfg), want, atol=1e-6, rtol=0)


def test_preprocessor_alpha_and_grey(tiny_gemma3):
    processor, cfg = tiny_gemma3[2], proc.Gemma3ProcessorConfig.from_hf(GEMMA_PRE, 32)
    rgba = synthetic_image(50, 40, seed=3).convert("RGBA")
    rgba.putalpha(Image.fromarray(np.tile(np.arange(50, dtype=np.uint8) * 5, (40, 1))))
    for image in (rgba, synthetic_image(33, 61, seed=4).convert("L")):
        want = processor.image_processor(images=[image], return_tensors="np")["pixel_values"][0]
        np.testing.assert_allclose(proc.preprocess(image, cfg), want, atol=1e-6, rtol=0)


def test_pan_and_scan_and_other_frame_sizes_are_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="do_pan_and_scan is on"):
        proc.Gemma3ProcessorConfig.from_hf({**GEMMA_PRE, "do_pan_and_scan": True}, 32)
    with pytest.raises(ModelLoadError, match="resized to the tower's 32 x 32"):
        proc.Gemma3ProcessorConfig.from_hf({**GEMMA_PRE, "size": {"height": 64, "width": 64}}, 32)
    assert proc.Gemma3ProcessorConfig.from_hf({}, 896).size == 896   # transformers' default: the tower's side


def test_a_checkpoint_turning_pan_and_scan_on_does_not_load(tiny_gemma3, tmp_path):
    path = tiny_gemma3[0]
    for f in path.iterdir():
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "preprocessor_config.json").unlink()
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**GEMMA_PRE, "do_pan_and_scan": True}))
    with pytest.raises(ModelLoadError, match="pan-and-scan crops are not supported"):
        load_model(tmp_path, dtype="float32")


def image_input(size: tuple[int, int], seed: int) -> ImageInput:
    pixels = np.asarray(synthetic_image(*size, seed=seed))
    return ImageInput(pixels, bytes([seed]) * 16, "PNG", 0)


def test_image_prompt_is_the_processors_expansion(tiny_gemma3):
    _, _, processor, loaded = tiny_gemma3
    family = image_family(loaded.vision)
    images = [synthetic_image(*s, seed=i) for i, s in enumerate(SIZES[:2])]
    text = "look: <start_of_image> and <start_of_image>, compare"
    want = processor(text=[text], images=[images], return_tensors="np")
    ours = text.replace("<start_of_image>", "\x00").replace("\x00", family.prompt(SIZES[0]))
    assert family.prompt(SIZES[1]) == family.prompt(SIZES[0]) == processor.full_image_sequence
    assert loaded.tokenizer.encode(ours, add_special_tokens=False) == list(want["input_ids"][0])
    assert (want["input_ids"][0] == 6).sum() == 2 * GEMMA_TOKENS


@pytest.mark.parametrize("parts", [["what is this?", "img"], ["img", "describe it"], ["img", "compare", "img"]])
def test_chat_route_prompt_ids_equal_the_processors(tiny_gemma3, parts):
    """The chat route's steps (image parts as marks in the message text, the chat template, expand, encode_chat)
    give the ids transformers' processor gives for the same message through the same template."""
    _, _, processor, loaded = tiny_gemma3
    family = image_family(loaded.vision)
    images = [image_input(s, i) for i, s in enumerate(SIZES[:parts.count("img")])]
    refs = iter(images)
    content = "".join(image_mark(next(refs)) if p == "img" else p for p in parts)
    marks = PromptImages([SimpleNamespace(video=None, param=f"p{i}") for i in range(len(images))], images)
    rendered = loaded.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                    add_generation_prompt=True)
    engine = SimpleNamespace(image_prompt=lambda image: family.prompt(image.size))   # AsyncEngine.image_prompt's
    text, in_order = expand(rendered, marks, engine, "messages", count_marks([content]))
    hf_content = [{"type": "image"} if p == "img" else {"type": "text", "text": p} for p in parts]
    hf_text = processor.apply_chat_template([{"role": "user", "content": hf_content}], add_generation_prompt=True,
                                            tokenize=False)
    want = processor(text=[hf_text], images=[[Image.fromarray(i.pixels) for i in images]], return_tensors="np")
    assert in_order == tuple(images)
    assert loaded.tokenizer.encode_chat(text) == list(want["input_ids"][0])


def key_limits(ids: list[int], image_token: int) -> np.ndarray:
    """Each token's key limit (AttentionMetadata.key_limit): an image token's is the last token of its run of
    image tokens (transformers' token_type_ids blocks), every other token's -1 (causal)."""
    is_image = np.asarray(ids) == image_token
    limit = np.full(len(ids), -1, np.int32)
    starts = np.flatnonzero(is_image & ~np.r_[False, is_image[:-1]])
    ends = np.flatnonzero(is_image & ~np.r_[is_image[1:], False])
    for a, b in zip(starts, ends):
        limit[a:b + 1] = b
    return limit


def prefill_logits(model, ids: list[int], rows: np.ndarray, image_token: int, cuts: tuple[int, ...] = (),
                   bidirectional: bool = False) -> np.ndarray:
    """Our model's logits [len(ids), V] for one prompt prefilled in chunks split at `cuts` through the engine's
    forward (step_programs.model_forward), each chunk given its own image rows (the k-th image token reads
    rows[k]) as (embed_rows, embed_slots) padded to 64 rows whose slot T writes nowhere; `bidirectional`: each
    image's tokens see each other (the metadata's key limits)."""
    T, M = 128, 64
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    forward = jax.jit(model_forward(model, graphdef, treedef))
    shape = model.kv_cache_shape(16, 16)
    kv = (jnp.zeros(shape), jnp.zeros(shape))
    image_index = np.cumsum(np.asarray(ids) == image_token) - 1
    out = []
    for a, b in zip((0, *cuts), (*cuts, len(ids))):
        batch = build_step_batch([SeqChunk(ids[a:b], a, list(range(1, 9)))], num_tokens=T, num_seqs=1,
                                 max_blocks=8, block_size=16)
        limit = np.full(T, -1, np.int32)
        limit[:b - a] = key_limits(ids, image_token)[a:b]
        meta = AttentionMetadata(*(jnp.asarray(x) for x in (batch.query_start_loc, batch.seq_lens,
                                                             batch.block_tables, batch.slot_mapping, batch.num_seqs)),
                                 key_limit=jnp.asarray(limit) if bidirectional else None)
        where = np.flatnonzero(np.asarray(ids[a:b]) == image_token)
        slots = np.full(M, T, np.int32)
        slots[:len(where)] = where
        chunk_rows = np.zeros((M, rows.shape[1]), np.float32)
        chunk_rows[:len(where)] = rows[image_index[a + where]]
        logits, kv = forward(leaves, kv, jnp.asarray(batch.input_ids), jnp.asarray(batch.positions), meta, None,
                             None, (jnp.asarray(chunk_rows), jnp.asarray(slots)))
        out.append(np.asarray(logits)[:b - a])
    return np.concatenate(out)


def image_prompt_ids(tiny_gemma3, sizes) -> tuple[list[int], np.ndarray, dict]:
    """A chat prompt with the images (transformers' processor), our rows for them, and transformers' inputs."""
    _, _, processor, loaded = tiny_gemma3
    content = [{"type": "text", "text": "what is in this picture?"}] + [{"type": "image"}] * len(sizes)
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    images = [synthetic_image(*s, seed=i) for i, s in enumerate(sizes)]
    inputs = processor(text=[text], images=[images], return_tensors="pt")
    family = image_family(loaded.vision)
    frames = np.concatenate([family.pixels(np.asarray(im))[0] for im in images])
    rows = np.asarray(loaded.vision.encoder(jnp.asarray(frames), jnp.ones((len(images), 8, 8), bool)))
    return inputs["input_ids"][0].tolist(), rows.reshape(-1, rows.shape[-1]), inputs


def test_causal_logits_with_an_image_match_transformers(tiny_gemma3):
    """Without token_type_ids transformers attends causally over the image too: the splice alone (image rows over
    the sqrt(hidden)-scaled text embeddings, not scaled) checked against it."""
    _, hf, _, loaded = tiny_gemma3
    ids, rows, inputs = image_prompt_ids(tiny_gemma3, [SIZES[0]])
    with torch.no_grad():
        want = hf(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"]).logits[0].numpy()
    np.testing.assert_allclose(prefill_logits(loaded.model, ids, rows, 6), want, atol=1e-4, rtol=0)


def test_bidirectional_logits_with_two_images_match_transformers(tiny_gemma3):
    """With token_type_ids (what Gemma3Processor returns) an image's tokens attend to each other both ways, within
    the sliding layers' window too; prefilled whole or in chunks cut between the images."""
    _, hf, _, loaded = tiny_gemma3
    ids, rows, inputs = image_prompt_ids(tiny_gemma3, [SIZES[0], SIZES[3]])
    with torch.no_grad():
        want = hf(**inputs).logits[0].numpy()
        causal = hf(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"]).logits[0].numpy()
    assert np.abs(want - causal).max() > 1e-2   # the key limit matters on this prompt
    at = np.flatnonzero(np.asarray(ids) == 6)
    for cuts in [(), (int(at[0]), int(at[15]) + 1, int(at[16]))]:   # chunks never end inside an image
        ours = prefill_logits(loaded.model, ids, rows, 6, cuts, bidirectional=True)
        np.testing.assert_allclose(ours, want, atol=1e-4, rtol=0)
