"""Idefics3 / SmolVLM directories through the main loader (model/formats/loader.py): the Llama decoder serves the
text, `loaded.vision` holds the image side, and text-only greedy output equals transformers'."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from paged import paged_greedy  # noqa: E402
from support.idefics3 import write_vlm  # noqa: E402
from imp_jax.errors import ModelLoadError  # noqa: E402
from imp_jax.model.base import takes_embed_rows  # noqa: E402
from imp_jax.model.architectures.llama import DecoderLM  # noqa: E402
from imp_jax.model.formats.loader import load_model  # noqa: E402
from imp_jax.model.vision.idefics3 import Idefics3Vision  # noqa: E402



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
