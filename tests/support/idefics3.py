"""A tiny random Idefics3 / SmolVLM (tests/test_vision_*.py): its directory written by transformers, its image
layouts in the tiny vocabulary, and an engine serving it (the `vlm` fixture, registered in conftest.py;
requests, prompts and pictures; running them to the end)."""
from __future__ import annotations

import hashlib
import itertools
import json
import re
from pathlib import Path

import numpy as np
import pytest
from paged import run_to_end
from tiny_models import write_tiny_tokenizer

from imp_jax.model.vision import idefics3_processor as proc
from imp_jax.runtime.config import EngineConfig
from imp_jax.runtime.request import GenerationRequest, ImageInput, SamplingParams
from support.vision import synthetic_image

IMAGE_TOKEN, FAKE, GLOBAL = 100, 101, 102


def layout_ids(layout: str) -> list[int]:
    """An image layout in the tiny vocab: each special token one stand-in id, any other character 10 + ord % 50."""
    named = {proc.IMAGE_TOKEN: IMAGE_TOKEN, proc.FAKE_TOKEN: FAKE, proc.GLOBAL_TOKEN: GLOBAL}
    ids = []
    for special, char in re.findall(r"(<[^<>]+>)|(.)", layout, flags=re.S):
        if char:
            ids.append(10 + ord(char) % 50)
        elif special in named:
            ids.append(named[special])
        else:
            r, c = map(int, re.fullmatch(r"<row_(\d)_col_(\d)>", special).groups())
            ids.append(103 + 4 * (r - 1) + c - 1)
    return ids


VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
              patch_size=4)


TEXT = dict(model_type="llama", vocab_size=256, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)


PRE = dict(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})


def write_vlm(path: Path, arch: str, tie: bool, seed: int = 0):
    """A random `arch` (Idefics3 / SmolVLM) with a tiny tokenizer and processor files; returns transformers' model.
    The text_config says the opposite of the top-level tie_word_embeddings: the top level must win."""
    import torch
    import transformers

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


ARCH = "SmolVLMForConditionalGeneration"


GREEDY = dict(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, max_tokens=6, ignore_eos=True)


SYSTEM = [1] + [10 + i % 40 for i in range(40)]   # 41 tokens: two full blocks before the first image


_ids = itertools.count()


def image(width: int, height: int, seed: int) -> ImageInput:
    pixels = np.asarray(synthetic_image(width, height, seed))
    return ImageInput(pixels, hashlib.blake2b(pixels.tobytes() + bytes(str(pixels.shape), "ascii"),
                                              digest_size=16).digest(), "PNG", 0)


def prompt(*images: ImageInput, tail=(7, 8, 9)) -> list[int]:
    ids = list(SYSTEM)
    for img in images:
        grid = proc.image_grid(*img.size, proc.ImageProcessorConfig.from_hf(dict(
            size={"longest_edge": 64}, max_image_size={"longest_edge": 32})))
        ids += layout_ids(proc.image_prompt(grid, 16)) + [5, 6]
    return ids + list(tail)


def request(ids: list[int], images: tuple[ImageInput, ...], **params) -> GenerationRequest:
    return GenerationRequest(f"img-{next(_ids)}", ids, SamplingParams(**{**GREEDY, **params}), images=images)


def run(core, *reqs: GenerationRequest, prepare: bool = True) -> list[dict]:
    """Run the requests together to the end (paged.run_to_end: pools back at their baselines)."""
    return run_to_end(core, *reqs, prepare=prepare, max_steps=300)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-smolvlm")
    hf = write_vlm(path, ARCH, tie=True)
    return path, hf


def config(path, budget: int, **kw) -> EngineConfig:
    return EngineConfig(model=str(path), max_model_len=256, max_num_seqs=4, max_num_batched_tokens=budget,
                        num_kv_blocks=96, image_cache_rows=16 * 12, seed=0, **kw)


PICS = {"a": (37, 53, 0), "b": (64, 64, 1), "c": (53, 37, 2)}


def pic(name: str) -> tuple[ImageInput, tuple[int, int, int]]:
    return image(*PICS[name]), PICS[name]
