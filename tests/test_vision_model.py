"""Idefics3 / SmolVLM directories through the main loader (model/loader.py): the Llama decoder serves the
text, `loaded.vision` holds the image side, and text-only greedy output equals transformers'."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiny_models import write_tiny_tokenizer  # noqa: E402
from paged import paged_greedy  # noqa: E402
from imp_jax.errors import ModelLoadError  # noqa: E402
from imp_jax.model.base import takes_embed_rows  # noqa: E402
from imp_jax.model.llama import DecoderLM  # noqa: E402
from imp_jax.model.loader import load_model  # noqa: E402
from imp_jax.model.vision.idefics3 import Idefics3Vision  # noqa: E402

VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
              patch_size=4)
TEXT = dict(model_type="llama", vocab_size=256, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
PRE = dict(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})


def write_vlm(path: Path, arch: str, tie: bool, seed: int = 0):
    """A random `arch` (Idefics3 / SmolVLM) with a tiny tokenizer and processor files; returns transformers' model.
    The text_config says the opposite of the top-level tie_word_embeddings: the top level must win."""
    name = arch.replace("ForConditionalGeneration", "")
    cfg = getattr(transformers, f"{name}Config")(vision_config=VISION, text_config={**TEXT, "tie_word_embeddings": not tie},
                                                 scale_factor=2, image_token_id=100, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).eval()
    with torch.no_grad():
        for _, p in model.model.text_model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    write_tiny_tokenizer(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PRE))
    (path / "processor_config.json").write_text(json.dumps({"image_seq_len": 16}))
    return model


@pytest.mark.parametrize("arch,tie", [("Idefics3ForConditionalGeneration", False),
                                      ("SmolVLMForConditionalGeneration", True)])
def test_load_model_serves_text_like_transformers_and_exposes_vision(tmp_path, arch, tie):
    hf = write_vlm(tmp_path, arch, tie)
    loaded = load_model(tmp_path, dtype="float32", gemm="exact")
    assert isinstance(loaded.model, DecoderLM) and takes_embed_rows(loaded.model)
    assert (loaded.config.architecture, loaded.config.tie_word_embeddings) == (arch, tie)
    assert (loaded.config.rms_norm_eps, loaded.config.vocab_size) == (1e-5, 256)
    v = loaded.vision
    assert isinstance(v.encoder, Idefics3Vision)
    assert (v.config.image_token_id, v.config.image_seq_len, v.processor.tile, v.processor.longest_edge) == (
        100, 16, 32, 64)
    ids = [1, 17, 42, 99, 7, 130, 5]
    with torch.no_grad():
        want = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                           pad_token_id=0)[0, len(ids):].tolist()
    assert paged_greedy(loaded.model, ids, 6) == want


def test_plain_llama_and_user_models_have_no_vision(tiny_hf_dir, tmp_path):
    assert load_model(tiny_hf_dir, dtype="float32").vision is None
    write_vlm(tmp_path, "Idefics3ForConditionalGeneration", False)
    user = load_model(tmp_path, dtype="float32", model_class="user_model_example:OneLayerLM")
    assert user.vision is None and not takes_embed_rows(user.model)   # it reads the text model's layer 0


def test_image_seq_len_must_match_the_connector(tmp_path):
    write_vlm(tmp_path, "Idefics3ForConditionalGeneration", False)
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_len": 64}))
    with pytest.raises(ModelLoadError, match="image_seq_len 64, but the connector gives 16"):
        load_model(tmp_path, dtype="float32")
