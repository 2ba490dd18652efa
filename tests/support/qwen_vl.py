"""A tiny random Qwen2.5-VL (tests/test_vision_qwen2_5_vl.py, tests/test_vision_engine_qwen.py): its special
token ids, sizes, and the `tiny_qwen` fixture (registered in conftest.py) that writes it with transformers."""
from __future__ import annotations

import json

import pytest
from tiny_models import write_tiny_tokenizer

IMAGE, VIDEO, START, END = 200, 201, 202, 203
VISION = dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, window_size=16, fullatt_block_indexes=[1, 3], out_hidden_size=64)
TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, bos_token_id=0, eos_token_id=1)
PRE = dict(min_pixels=16 * 16, max_pixels=48 * 48, patch_size=4, temporal_patch_size=2, merge_size=2)


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory: pytest.TempPathFactory):
    """A random Qwen2.5-VL (a 4-block windowed tower, window 16 px = 2 x 2 merge blocks; a 2-layer Qwen2 with
    M-RoPE sections 2/3/3) saved by transformers with a tiny tokenizer, and the model itself."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2_5_VLConfig(vision_config=VISION, text_config=TEXT, image_token_id=IMAGE,
                                        video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():   # norms and biases away from their init, so a wrong one shows
        for _, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.3)
    path = tmp_path_factory.mktemp("tiny-qwen2.5-vl")
    model.save_pretrained(path)
    write_tiny_tokenizer(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PRE))
    return path, model
