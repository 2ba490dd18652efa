"""Idefics3 / SmolVLM's image side (model/vision/) against transformers: the tower + connector's rows, the
preprocessor's frames and masks, the prompt expansion, and a whole prompt's logits with one image spliced in."""
from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from support.idefics3 import IMAGE_TOKEN, layout_ids  # noqa: E402
from support.vision import synthetic_image  # noqa: E402
from imp_jax.kernels_pallas import AttentionMetadata  # noqa: E402
from imp_jax.model.vision import idefics3_processor as proc  # noqa: E402
from imp_jax.model.vision.idefics3 import patch_mask  # noqa: E402
from imp_jax.model.vision.loader import load_idefics3  # noqa: E402
from imp_jax.model.vision.siglip import position_boundaries  # noqa: E402
from imp_jax.runtime.execution.batch import SeqChunk, build_step_batch  # noqa: E402

SIZES = [(37, 53), (64, 64), (200, 90), (20, 300)]   # PIL (width, height)
TINY = dict(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=32, patch_size=4),
            text_config=dict(model_type="llama", vocab_size=128, hidden_size=48, intermediate_size=96,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False),
            scale_factor=2, image_token_id=IMAGE_TOKEN)
PRE = dict(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})   # tiles of 32: up to 2 x 2 + 1


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory):
    """A random Idefics3 (vision hidden 32, 2 layers, patch 4, image 32, scale 2; a 2-layer Llama) saved by
    transformers, and the model itself."""
    torch.manual_seed(0)
    cfg = transformers.Idefics3Config(**TINY)
    model = transformers.Idefics3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():   # position and LayerNorm tables away from their init, so a wrong lookup shows
        for name, p in model.model.vision_model.named_parameters():
            if "position_embedding" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.5)
    path = tmp_path_factory.mktemp("tiny-idefics3")
    model.save_pretrained(path)
    return path, model


def hf_image_features(model, pixels: np.ndarray, mask: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model.model.get_image_features(torch.tensor(pixels[None]), torch.tensor(mask[None]))
    return torch.cat(list(out.pooler_output)).numpy()


@pytest.mark.parametrize("frames", [
    [(32, 32, 32, 32)],                                   # one whole frame
    [(32, 32, 32, 32), (32, 32, 20, 28), (32, 32, 9, 32)],  # partial patch grids (padding bottom / right)
    [(48, 48, 48, 48), (48, 48, 40, 30)],                 # larger than image_size: bucketed positions
    [(16, 16, 16, 16), (16, 16, 13, 16)],                 # smaller than image_size
])
def test_tower_and_connector_match_transformers(tiny_vlm, frames):
    path, hf = tiny_vlm
    vlm = load_idefics3(path)
    rng = np.random.default_rng(len(frames))
    H, W = frames[0][:2]
    pixels = rng.normal(size=(len(frames), 3, H, W)).astype(np.float32)
    mask = np.zeros((len(frames), H, W), np.int64)
    for i, (_, _, h, w) in enumerate(frames):
        mask[i, :h, :w] = 1
        pixels[i, :, h:, :] = 0
        pixels[i, :, :, w:] = 0
    forward = nnx.jit(lambda m, p, pm: m(p, pm))
    ours = np.asarray(forward(vlm.vision, jnp.asarray(pixels), jnp.asarray(patch_mask(mask, 4))))
    want = hf_image_features(hf, pixels, mask)
    assert ours.shape == (len(frames), (H // 8) ** 2, 48)
    np.testing.assert_allclose(ours.reshape(want.shape), want, atol=1e-4, rtol=0)


def test_loader_reads_the_text_model_and_refuses_other_architectures(tiny_vlm, tmp_path):
    from imp_jax.errors import ModelLoadError

    path, _ = tiny_vlm
    vlm = load_idefics3(path)
    assert (vlm.text_config.architecture, vlm.text_config.num_layers, vlm.text_config.hidden_size) == (
        "LlamaForCausalLM", 2, 48)
    assert (vlm.config.image_seq_len, vlm.config.image_token_id) == (16, IMAGE_TOKEN)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelLoadError, match="is not one of Idefics3ForConditionalGeneration"):
        load_idefics3(tmp_path)


def test_smolvlm_checkpoint_and_preprocessor_match_transformers(tmp_path):
    """SmolVLM saves the same names and preprocesses the same way: one image end to end through the tower."""
    torch.manual_seed(1)
    hf = transformers.SmolVLMForConditionalGeneration(transformers.SmolVLMConfig(**TINY)).eval()
    hf.save_pretrained(tmp_path)
    vlm = load_idefics3(tmp_path)
    image = synthetic_image(*SIZES[2], seed=5)
    want = transformers.SmolVLMImageProcessor(**PRE)(images=[image], return_tensors="np", return_row_col_info=True)
    ours = proc.preprocess([image], proc.ImageProcessorConfig.from_hf(PRE))
    np.testing.assert_allclose(ours.pixel_values, want["pixel_values"][0], atol=1e-6, rtol=0)
    np.testing.assert_array_equal(ours.pixel_attention_mask, want["pixel_attention_mask"][0])
    rows = vlm.vision(jnp.asarray(ours.pixel_values), jnp.asarray(patch_mask(ours.pixel_attention_mask, 4)))
    want_rows = hf_image_features(hf, want["pixel_values"][0], want["pixel_attention_mask"][0])
    np.testing.assert_allclose(np.asarray(rows).reshape(want_rows.shape), want_rows, atol=1e-4, rtol=0)


def test_padding_frames_change_no_real_rows(tiny_vlm):
    """A bucket of N frames padded with zero frames (mask all off or all on) gives the real frames' rows
    bit for bit, and no NaN: the engine may round the frame count up."""
    vlm = load_idefics3(tiny_vlm[0])
    forward = nnx.jit(lambda m, p, pm: m(p, pm))
    pixels = np.random.default_rng(0).normal(size=(3, 3, 32, 32)).astype(np.float32)
    real = np.asarray(forward(vlm.vision, jnp.asarray(pixels), jnp.ones((3, 8, 8), bool)))
    padded = jnp.asarray(np.concatenate([pixels, np.zeros((1, 3, 32, 32), np.float32)]))
    for fill in (False, True):
        mask = jnp.concatenate([jnp.ones((3, 8, 8), bool), jnp.full((1, 8, 8), fill)])
        out = np.asarray(forward(vlm.vision, padded, mask))
        assert not np.isnan(out).any()
        np.testing.assert_array_equal(out[:3], real)


def test_position_boundaries_are_torch_arange():
    """Bit-exact for the grids real checkpoints use (Idefics3-8B 364/14 = 26, SmolVLM 512/16 = 32); torch's
    CPU arange rounds a few other sides (27, 29) one float32 ulp away from the float64 values."""
    for n in (7, 8, 12, 14, 26, 32):
        want = torch.arange(1 / n, 1.0, 1 / n).numpy()
        np.testing.assert_array_equal(position_boundaries(n), want)


def hf_image_processor():
    return transformers.Idefics3ImageProcessor(**PRE)


@pytest.mark.parametrize("size", SIZES)
def test_preprocessor_matches_transformers(size):
    image = synthetic_image(*size)
    want = hf_image_processor()(images=[image], return_tensors="np", return_row_col_info=True)
    ours = proc.preprocess([image], proc.ImageProcessorConfig.from_hf(PRE))
    np.testing.assert_allclose(ours.pixel_values, want["pixel_values"][0], atol=1e-6, rtol=0)
    np.testing.assert_array_equal(ours.pixel_attention_mask, want["pixel_attention_mask"][0])
    assert ours.grids == ((want["rows"][0][0], want["cols"][0][0]),)


@pytest.mark.parametrize("pre", [PRE, {**PRE, "do_image_splitting": False}, {**PRE, "do_resize": False},
                                 {"size": {"longest_edge": 1456}, "max_image_size": {"longest_edge": 364}}])
def test_image_grid_from_size_alone_equals_the_frames_cut(pre):
    cfg = proc.ImageProcessorConfig.from_hf(pre)
    for w, h in SIZES + [(1, 1), (33, 32), (2000, 1000), (365, 1500)]:
        grid = proc.image_frames(synthetic_image(w, h), cfg)[1]
        assert proc.image_grid(w, h, cfg) == grid, (w, h)


def test_preprocessor_config_reads_hf_json():
    hf = hf_image_processor().to_dict()
    cfg = proc.ImageProcessorConfig.from_hf(json.loads(json.dumps(hf)))
    assert (cfg.longest_edge, cfg.tile, cfg.resample) == (64, 32, Image.Resampling.LANCZOS)


def test_preprocessor_several_images_and_alpha():
    rgba = synthetic_image(50, 40, seed=3).convert("RGBA")
    rgba.putalpha(Image.fromarray(np.tile(np.arange(50, dtype=np.uint8) * 5, (40, 1))))
    images = [synthetic_image(*SIZES[0]), rgba, synthetic_image(*SIZES[3], seed=2)]
    want = hf_image_processor()(images=[images], return_tensors="np", return_row_col_info=True)
    ours = proc.preprocess(images, proc.ImageProcessorConfig.from_hf(PRE))
    np.testing.assert_allclose(ours.pixel_values, want["pixel_values"][0], atol=1e-6, rtol=0)
    np.testing.assert_array_equal(ours.pixel_attention_mask, want["pixel_attention_mask"][0])
    assert [g for g in ours.grids] == list(zip(want["rows"][0], want["cols"][0]))
    assert sum(ours.frames_per_image) == ours.pixel_values.shape[0]


def tiny_processor(image_seq_len: int = 16):
    """transformers' Idefics3Processor over a byte-level tokenizer holding the image special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [proc.FAKE_TOKEN, proc.IMAGE_TOKEN, "<end_of_utterance>", proc.GLOBAL_TOKEN] + [
        f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"additional_special_tokens": specials})
    return transformers.Idefics3Processor(hf_image_processor(), fast, image_seq_len=image_seq_len)


def test_prompt_expansion_matches_transformers():
    processor = tiny_processor()
    images = [synthetic_image(*s, seed=i) for i, s in enumerate(SIZES)]
    text = "User:<image>what is this?<image>\nand these: <image><image><end_of_utterance>\nAssistant:"
    want = processor(images=images, text=[text])["input_ids"][0]
    grids = proc.preprocess(images, proc.ImageProcessorConfig.from_hf(PRE)).grids
    expanded = proc.expand_prompt(text, grids, 16)
    assert processor.tokenizer(expanded)["input_ids"] == list(want)
    assert processor.tokenizer.decode(want) == expanded
    tiles = sum(r * c + 1 if r else 1 for r, c in grids)
    image_id = processor.tokenizer.convert_tokens_to_ids(proc.IMAGE_TOKEN)
    assert len(proc.image_token_positions(want, image_id)) == 16 * tiles


def test_expand_prompt_counts_must_agree():
    with pytest.raises(ValueError, match="2 <image> tokens for 1 images"):
        proc.expand_prompt("<image><image>", [(0, 0)], 4)


def prefill_logits(text, ids: list[int], rows: np.ndarray, cuts: tuple[int, ...] = (), M: int = 128) -> np.ndarray:
    """Our Llama's logits [len(ids), V] for one prompt prefilled in chunks split at `cuts` (paged KV carried
    over), each chunk given only its own image rows (the k-th `<image>` token reads rows[k]) through the
    model's `embed_rows`/`embed_slots`, padded to M rows whose slot T writes nowhere."""
    T = 128
    forward = nnx.jit(lambda m, ids, pos, kv, meta, r, s: m(ids, pos, kv, meta, embed_rows=r, embed_slots=s))
    shape = text.kv_cache_shape(16, 16)
    kv = (jnp.zeros(shape), jnp.zeros(shape))
    image_index = np.cumsum(np.asarray(ids) == IMAGE_TOKEN) - 1   # each token's row in `rows` (if an image)
    out = []
    for a, b in zip((0, *cuts), (*cuts, len(ids))):
        batch = build_step_batch([SeqChunk(ids[a:b], a, list(range(1, 9)))], num_tokens=T, num_seqs=1,
                                 max_blocks=8, block_size=16)
        meta = AttentionMetadata(*(jnp.asarray(x) for x in (batch.query_start_loc, batch.seq_lens,
                                                             batch.block_tables, batch.slot_mapping, batch.num_seqs)))
        where = np.flatnonzero(np.asarray(ids[a:b]) == IMAGE_TOKEN)
        slots = np.full(M, T, np.int32)
        slots[:len(where)] = where
        chunk_rows = np.zeros((M, rows.shape[1]), np.float32)
        chunk_rows[:len(where)] = rows[image_index[a + where]]
        hidden, kv = forward(text, jnp.asarray(batch.input_ids), jnp.asarray(batch.positions), kv, meta,
                             jnp.asarray(chunk_rows), jnp.asarray(slots))
        out.append(np.asarray(text.logits(hidden[:b - a])))
    return np.concatenate(out)


def one_image_prompt(vlm) -> tuple[list[int], np.ndarray, dict]:
    """A prompt with one image (5 frames: 2 x 2 tiles + global), its image rows, and transformers' inputs."""
    pre = proc.preprocess([synthetic_image(*SIZES[0])], proc.ImageProcessorConfig.from_hf(PRE))
    layout = proc.image_prompt(pre.grids[0], vlm.config.image_seq_len)
    ids = [1, 5, 6] + layout_ids(layout) + [7, 8, 9]
    assert ids.count(IMAGE_TOKEN) == 16 * sum(pre.frames_per_image)
    rows = np.asarray(vlm.vision(jnp.asarray(pre.pixel_values),
                                 jnp.asarray(patch_mask(pre.pixel_attention_mask, 4)))).reshape(-1, 48)
    return ids, rows, dict(pixel_values=torch.tensor(pre.pixel_values[None]),
                           pixel_attention_mask=torch.tensor(pre.pixel_attention_mask[None]))


def test_logits_with_one_image_match_transformers(tiny_vlm):
    path, hf = tiny_vlm
    vlm = load_idefics3(path)
    ids, rows, images = one_image_prompt(vlm)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids]), **images).logits[0].numpy()
    ours = prefill_logits(vlm.text, ids, rows)
    np.testing.assert_allclose(ours, want, atol=1e-4, rtol=0)
    # greedy continuation: the image sits in the prompt's KV only, so later steps are plain text
    with torch.no_grad():
        gen = hf.generate(input_ids=torch.tensor([ids]), **images, max_new_tokens=5, do_sample=False,
                          pad_token_id=0)[0, len(ids):].tolist()
    seq = list(ids)
    for _ in range(5):
        seq.append(int(np.argmax(prefill_logits(vlm.text, seq, rows)[-1])))
    assert seq[len(ids):] == gen


def test_chunked_prefill_with_image_rows_equals_one_chunk(tiny_vlm):
    """A prefill cut inside the image, each chunk given only its own slice of the rows (slots relative to
    the chunk), gives one chunk's logits: the engine may split a prompt's image over steps."""
    vlm = load_idefics3(tiny_vlm[0])
    ids, rows, _ = one_image_prompt(vlm)
    image_at = [i for i, t in enumerate(ids) if t == IMAGE_TOKEN]
    whole = prefill_logits(vlm.text, ids, rows)
    for cuts in [(image_at[37],), (image_at[5], image_at[60] + 1)]:
        np.testing.assert_allclose(prefill_logits(vlm.text, ids, rows, cuts), whole, atol=1e-5, rtol=0)
