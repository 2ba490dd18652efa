"""A tiny random Gemma 3 with its image side (tests/test_vision_gemma3.py, tests/test_vision_gemma3_engine.py):
the `tiny_gemma3` fixture (registered in conftest.py) writes it with scripts/tiny_vlm.py and loads it."""
from __future__ import annotations

import pytest
from tiny_vlm import hf_gemma3_processor, write_tiny_gemma3

from imp_jax.model.formats.loader import load_model


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory):
    """(path, transformers' model, its processor, our loaded model)."""
    path = tmp_path_factory.mktemp("tiny-gemma3")
    hf = write_tiny_gemma3(path)
    return path, hf, hf_gemma3_processor(path), load_model(path, dtype="float32", gemm="exact")
