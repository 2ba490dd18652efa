"""Qwen2.5-VL (model/vision/qwen2_5_vl*.py, mrope.py, the decoder's M-RoPE) against transformers on a tiny random
checkpoint: the windowed tower + merger, the PIL preprocessing, the prompt expansion, get_rope_index, whole-model
logits and greedy tokens with an image, and text-only generation through the main loader."""
from __future__ import annotations

import json
import logging

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from paged import paged_greedy  # noqa: E402
from support.qwen_vl import END, IMAGE, PRE, START, TEXT, VISION  # noqa: E402
from support.vision import synthetic_image  # noqa: E402
from imp_jax.errors import ModelLoadError  # noqa: E402
from imp_jax.kernels_pallas import AttentionMetadata  # noqa: E402
from imp_jax.model.config import ModelConfig  # noqa: E402
from imp_jax.model.architectures.llama import DecoderLM  # noqa: E402
from imp_jax.model.formats.loader import load_model  # noqa: E402
from imp_jax.model.vision import qwen2_5_vl_processor as proc  # noqa: E402
from imp_jax.model.vision.mrope import get_rope_index  # noqa: E402
from imp_jax.model.vision.qwen2_5_vl import Qwen25Vision, VisionLayout  # noqa: E402
from imp_jax.runtime.execution.batch import SeqChunk, build_step_batch  # noqa: E402

SIZES = [(37, 53), (64, 64), (200, 90), (20, 300), (9, 9)]   # PIL (width, height): down, square, wide, tall, up


@pytest.fixture(scope="module")
def loaded(tiny_qwen):
    return load_model(tiny_qwen[0], dtype="float32", gemm="exact")


def hf_rows(hf, patches: np.ndarray, grids) -> np.ndarray:
    with torch.no_grad():
        return hf.model.visual(torch.tensor(patches), grid_thw=torch.tensor(grids)).pooler_output.numpy()


@pytest.mark.parametrize("grids", [[(1, 6, 10)], [(1, 6, 10), (1, 16, 12)], [(1, 4, 4), (1, 2, 14), (1, 8, 8)]])
def test_tower_and_merger_match_transformers(tiny_qwen, loaded, grids):
    """One image, two and three of different sizes (partial windows at the edges) in one call."""
    hf, vision = tiny_qwen[1], loaded.vision
    patches = np.random.default_rng(len(grids)).normal(
        size=(sum(t * h * w for t, h, w in grids), vision.config.vision.patch_dim)).astype(np.float32)
    ours = vision.encoder.encode(patches, grids)
    want = hf_rows(hf, patches, grids)
    assert ours.shape == want.shape == (sum(vision.config.rows(g) for g in grids), 64)
    np.testing.assert_allclose(ours, want, atol=1e-4, rtol=0)


def test_bucketed_layout_changes_no_real_rows(loaded):
    """Padding patches (zeros) and empty windows up to a bucket give the real rows and no NaN (within float
    rounding: the full-attention layers' softmax runs over the bucket's length, masked)."""
    enc, c = loaded.vision.encoder, loaded.vision.config.vision
    grids = [(1, 6, 10), (1, 4, 6)]
    forward = nnx.jit(lambda m, *a: m(*a))
    patches = np.random.default_rng(0).normal(size=(84, c.patch_dim)).astype(np.float32)

    def run(layout, x):
        return np.asarray(forward(enc, jnp.asarray(x), *(jnp.asarray(a) for a in (
            layout.positions, layout.segments, layout.windows))))
    real = run(VisionLayout.of(grids, c), patches)
    padded = run(VisionLayout.of(grids, c, num_patches=128, num_windows=16),
                 np.concatenate([patches, np.zeros((44, c.patch_dim), np.float32)]))
    assert not np.isnan(padded).any()
    np.testing.assert_allclose(padded[:21], real, atol=1e-6, rtol=0)


def test_windows_are_transformers_window_index(loaded):
    from transformers.vision_utils import get_vision_window_index

    c = loaded.vision.config.vision
    grids = [(1, 6, 10), (1, 16, 12), (2, 4, 8)]
    layout = VisionLayout.of(grids, c)
    units = np.concatenate([w[w < layout.num_real][::4] // 4 for w in layout.windows])
    want, _ = get_vision_window_index(torch.tensor(grids), 2, c.window_size, c.patch_size)
    np.testing.assert_array_equal(units, want.numpy())


def hf_image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil(**PRE)


@pytest.mark.parametrize("size", SIZES)
def test_preprocessor_matches_transformers(size):
    image = synthetic_image(*size)
    want = hf_image_processor()(images=[image], return_tensors="np")
    ours = proc.preprocess([image], proc.Qwen2VLProcessorConfig.from_hf(PRE))
    np.testing.assert_array_equal(ours.pixel_values, want["pixel_values"])
    assert ours.image_grid_thw == tuple(map(tuple, want["image_grid_thw"].tolist()))
    assert proc.image_grid(*size, proc.Qwen2VLProcessorConfig.from_hf(PRE)) == ours.image_grid_thw[0]


def test_preprocessor_several_images_alpha_and_hf_json():
    rgba = synthetic_image(50, 40, seed=3).convert("RGBA")
    rgba.putalpha(Image.fromarray(np.tile(np.arange(50, dtype=np.uint8) * 5, (40, 1))))
    images = [synthetic_image(*SIZES[0]), rgba, synthetic_image(*SIZES[3], seed=2)]
    hf = hf_image_processor()
    cfg = proc.Qwen2VLProcessorConfig.from_hf(json.loads(json.dumps(hf.to_dict())))
    assert (cfg.min_pixels, cfg.max_pixels, cfg.patch_size, cfg.resample) == (256, 2304, 4, Image.Resampling.BICUBIC)
    want = hf(images=images, return_tensors="np")
    ours = proc.preprocess(images, cfg)
    np.testing.assert_array_equal(ours.pixel_values, want["pixel_values"])
    assert ours.image_grid_thw == tuple(map(tuple, want["image_grid_thw"].tolist()))


def test_prompt_expansion_and_rope_index_match_transformers(tiny_qwen):
    hf = tiny_qwen[1]
    grids = proc.preprocess([synthetic_image(*SIZES[0]), synthetic_image(*SIZES[2])],
                            proc.Qwen2VLProcessorConfig.from_hf(PRE)).image_grid_thw
    one = f"{proc.VISION_START}{proc.IMAGE_TOKEN}{proc.VISION_END}"   # what the chat template writes
    text = f"hi {one} and {one}?"
    expanded = proc.expand_prompt(text, grids, 2)
    assert expanded.count(proc.IMAGE_TOKEN) == sum(t * h * w // 4 for t, h, w in grids)
    assert expanded.startswith("hi " + proc.image_prompt(grids[0], 2) + " and ")
    with pytest.raises(ValueError, match="2 <|image_pad|> tokens for 1 images"):
        proc.expand_prompt(text, grids[:1], 2)
    ids = [5, 6, START] + [IMAGE] * (grids[0][1] * grids[0][2] // 4) + [END, 7, 8, 9, START] + [
        IMAGE] * (grids[1][1] * grids[1][2] // 4) + [END, 10]
    positions, delta = get_rope_index(ids, grids, IMAGE, 2)
    t = torch.tensor([ids])
    want, want_delta = hf.model.get_rope_index(t, mm_token_type_ids=(t == IMAGE).int(),
                                               image_grid_thw=torch.tensor(grids))
    np.testing.assert_array_equal(positions, want[:, 0].numpy())
    assert delta == int(want_delta) < 0


def step_inputs(seq: list[int], positions: np.ndarray, rows: np.ndarray, T: int = 128, M: int = 64):
    """One paged prefill of `seq`: the batch's arrays, M-RoPE positions [3, T] and the image rows over the
    image tokens (padded to M rows whose slot T writes nowhere)."""
    b = build_step_batch([SeqChunk(seq, 0, list(range(1, 9)))], num_tokens=T, num_seqs=1, max_blocks=8,
                         block_size=16)
    meta = AttentionMetadata(*(jnp.asarray(x) for x in (b.query_start_loc, b.seq_lens, b.block_tables,
                                                         b.slot_mapping, b.num_seqs)))
    pos = np.broadcast_to(np.asarray(b.positions), (3, T)).copy()
    pos[:, :len(seq)] = positions
    where = np.flatnonzero(np.asarray(seq) == IMAGE)
    slots = np.full(M, T, np.int32)
    slots[:len(where)] = where
    padded = np.zeros((M, rows.shape[1]), np.float32)
    padded[:len(where)] = rows
    return jnp.asarray(b.input_ids), jnp.asarray(pos), meta, jnp.asarray(padded), jnp.asarray(slots)


def test_logits_and_greedy_tokens_with_one_image_match_transformers(tiny_qwen, loaded):
    hf, model, vision = tiny_qwen[1], loaded.model, loaded.vision
    pre = proc.preprocess([synthetic_image(*SIZES[0])], vision.processor)
    rows = vision.encoder.encode(pre.pixel_values, pre.image_grid_thw)
    ids = [5, 6, START] + [IMAGE] * len(rows) + [END, 7, 8]
    positions, delta = get_rope_index(ids, pre.image_grid_thw, IMAGE, 2)
    forward = nnx.jit(lambda m, ids, pos, kv, meta, r, s: m(ids, pos, kv, meta, embed_rows=r, embed_slots=s))
    shape = model.kv_cache_shape(16, 16)

    def logits(seq, pos):
        ids_, pos_, meta, r, s = step_inputs(seq, pos, rows)
        hidden, _ = forward(model, ids_, pos_, (jnp.zeros(shape), jnp.zeros(shape)), meta, r, s)
        return np.asarray(model.logits(hidden[:len(seq)]))

    images = dict(pixel_values=torch.tensor(pre.pixel_values), image_grid_thw=torch.tensor(pre.image_grid_thw),
                  mm_token_type_ids=(torch.tensor([ids]) == IMAGE).int())
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids]), **images).logits[0].numpy()
        gen = hf.generate(input_ids=torch.tensor([ids]), **images, max_new_tokens=5, do_sample=False,
                          pad_token_id=0)[0, len(ids):].tolist()
    np.testing.assert_allclose(logits(ids, positions), want, atol=1e-4, rtol=0)
    seq, pos = list(ids), positions
    for _ in range(5):   # decode token i sits at i + delta in all three components
        seq.append(int(np.argmax(logits(seq, pos)[-1])))
        pos = np.concatenate([pos, np.full((3, 1), len(seq) - 1 + delta)], axis=1)
    assert seq[len(ids):] == gen


def test_text_only_generation_matches_transformers(tiny_qwen, loaded):
    hf = tiny_qwen[1]
    assert isinstance(loaded.model, DecoderLM) and loaded.vision.family == "qwen2_5_vl"
    assert isinstance(loaded.vision.encoder, Qwen25Vision) and loaded.vision.config.image_token_id == IMAGE
    assert (loaded.config.mrope_section, loaded.config.attention_bias) == ((2, 3, 3), True)
    ids = [1, 17, 42, 99, 7, 130, 5]
    got = paged_greedy(loaded.model, ids, 6)   # [T] positions: the engine's existing call
    with torch.no_grad():
        want = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                           pad_token_id=0)[0, len(ids):].tolist()
    assert got == want


def test_the_engine_serves_qwen2_5_vl_images(loaded, caplog, monkeypatch):
    """Qwen2.5-VL's image side is served (tests/test_vision_engine_qwen.py); a family left out of SERVED_VISION
    would be dropped at build, the model served as text."""
    from imp_jax.runtime.core import builder

    assert builder.served_vision(loaded) is loaded and "qwen2_5_vl" in builder.SERVED_VISION
    monkeypatch.setattr(builder, "SERVED_VISION", {"idefics3": "Idefics3 / SmolVLM"})
    with caplog.at_level(logging.INFO, logger="imp_jax.engine"):
        served = builder.served_vision(loaded)
    assert served.vision is None and served.model is loaded.model and loaded.vision is not None
    assert "serving it as text" in caplog.text and "Qwen2_5_VLForConditionalGeneration" in caplog.text


def test_flat_hub_config_and_bad_sections():
    """The hub's Qwen2.5-VL configs are flat (text fields at the top level, rope_scaling type mrope)."""
    flat = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
            **{k: v for k, v in TEXT.items() if k != "rope_scaling"}, "tie_word_embeddings": True,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}, "vision_config": VISION}
    cfg = ModelConfig.from_hf(flat)
    assert (cfg.mrope_section, cfg.tie_word_embeddings, cfg.attention_bias, cfg.rope_scaling.rope_type) == (
        (2, 3, 3), True, True, "default")
    with pytest.raises(ModelLoadError, match="'mrope_section' must be 3 counts adding up to 8"):
        ModelConfig.from_hf({**flat, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 4]}})


def test_mrope_with_equal_components_is_plain_rope():
    """Text tokens (all three components equal) rotate exactly as the [T] positions the engine passes."""
    from imp_jax.model.layers import mrope_tables, rope_tables

    inv = ModelConfig.from_hf({"architectures": ["Qwen2_5_VLForConditionalGeneration"], "vision_config": VISION,
                               "text_config": TEXT}).rope_inv_freq()
    pos = jnp.arange(0, 300, 7)
    for a, b in zip(mrope_tables(jnp.stack([pos] * 3), inv, (2, 3, 3)), rope_tables(pos, inv)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_full_attention_in_query_chunks_equals_one_step():
    from imp_jax.model.vision.qwen2_5_vl import frame_attention

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(70, 2, 8)).astype(np.float32)) for _ in range(3))
    segments = jnp.asarray(np.repeat([0, 1, 2, -1], [30, 20, 12, 8]).astype(np.int32))
    np.testing.assert_allclose(np.asarray(frame_attention(q, k, v, segments, chunk=16)),
                               np.asarray(frame_attention(q, k, v, segments, chunk=128)), atol=1e-6, rtol=0)


def test_processor_sizes_must_match_the_tower(tiny_qwen, tmp_path):
    import shutil

    shutil.copytree(tiny_qwen[0], tmp_path, dirs_exist_ok=True)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**PRE, "patch_size": 14}))
    with pytest.raises(ModelLoadError, match="differ from the tower's 4/2/2"):
        load_model(tmp_path, dtype="float32")
