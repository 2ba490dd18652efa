"""Load an Idefics3 / SmolVLM HF directory: the image side (model/vision/idefics3.py) and its Llama text model.

The engine loads these through model/formats/loader.py (the image side as `LoadedModel.vision`, model/vision/side.py);
this builds both halves directly, for tests and tools.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from imp_jax.errors import ModelLoadError
from imp_jax.model.base import ModelOptions
from imp_jax.model.config import ModelConfig, read_json
from imp_jax.model.language_model_config import language_model_config
from imp_jax.model.architectures.llama import DecoderLM
from imp_jax.model.formats.loader import SafetensorsDir
from imp_jax.model.vision.idefics3 import ARCHITECTURES, Idefics3Config, Idefics3Vision
from imp_jax.model.vision.side import TextModelTensors, build_vision, open_vision
from imp_jax.model.weights import WeightSource


def text_config(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """The text model's ModelConfig from an Idefics3 / SmolVLM config.json (its `text_config`, as a Llama)."""
    archs = hf.get("architectures") or ["Idefics3ForConditionalGeneration"]
    text = language_model_config(hf, archs, source)
    return ModelConfig.from_hf({**text, "architectures": ["LlamaForCausalLM"]}, source=f"{source} text_config")


@dataclasses.dataclass
class VisionLanguageModel:
    """An Idefics3 / SmolVLM checkpoint, built: the image side and the causal LM it feeds."""

    vision: Idefics3Vision
    text: DecoderLM
    config: Idefics3Config
    text_config: ModelConfig
    preprocessor: dict[str, Any]   # preprocessor_config.json ({} when absent)


def load_idefics3(path: str | Path, options: ModelOptions = ModelOptions(),
                  vision_dtype: Any = jnp.float32) -> VisionLanguageModel:
    """Build both halves from an HF directory (config.json + safetensors)."""
    path = Path(path)
    hf = read_json(path / "config.json")
    source = str(path / "config.json")
    archs = hf.get("architectures") if isinstance(hf, dict) else None
    if not isinstance(archs, list) or not archs or archs[0] not in ARCHITECTURES:
        raise ModelLoadError(f"{source}: architecture {archs!r} is not one of {', '.join(ARCHITECTURES)}")
    tcfg, tensors = text_config(hf, source), SafetensorsDir(path)
    side = build_vision(open_vision(path, hf, tensors), vision_dtype)   # as the main loader builds it
    config, vision = side.config, side.encoder
    try:
        text = DecoderLM.from_hf_tensors(tcfg, WeightSource(TextModelTensors(tensors), source=str(path)), options)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    pre = path / "preprocessor_config.json"
    return VisionLanguageModel(vision, text, config, tcfg, read_json(pre) if pre.is_file() else {})
