"""Load an Idefics3 / SmolVLM HF directory: the image side (model/vision/idefics3.py) and its Llama text model.

transformers saves `Idefics3ForConditionalGeneration` as `model.vision_model.*`, `model.connector.*`,
`model.text_model.*` and `lm_head.weight`; the text model is a plain Llama (SmolLM2), so the
existing `DecoderLM` reads it through `TextModelTensors`, a view that drops the `text_model.` level.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterator, Mapping

import jax.numpy as jnp
import numpy as np

from imp_jax.errors import ModelLoadError
from imp_jax.model.base import ModelOptions
from imp_jax.model.config import ModelConfig, read_json
from imp_jax.model.llama import DecoderLM
from imp_jax.model.loader import SafetensorsDir
from imp_jax.model.vision.idefics3 import ARCHITECTURES, Idefics3Config, Idefics3Vision
from imp_jax.model.weights import WeightSource

TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM"}   # text_config.model_type -> the class DecoderLM serves


class TextModelTensors(Mapping[str, np.ndarray]):
    """The text model's tensors under the names a causal LM has: `model.text_model.X` as `model.X`."""

    def __init__(self, tensors: Mapping[str, np.ndarray]):
        self._tensors = tensors

    def _name(self, name: str) -> str:
        return "model.text_model." + name[len("model."):] if name.startswith("model.") else name

    def __getitem__(self, name: str) -> np.ndarray:
        return self._tensors[self._name(name)]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._name(name) in self._tensors

    def __iter__(self) -> Iterator[str]:
        pre = "model.text_model."
        return (("model." + k[len(pre):]) if k.startswith(pre) else k for k in self._tensors
                if k.startswith(pre) or not k.startswith("model."))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def text_config(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """The text model's ModelConfig from an Idefics3 / SmolVLM config.json (its `text_config`)."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError(f"{source}: expected a 'text_config' object")
    kind = text.get("model_type", "llama")
    if kind not in TEXT_ARCHITECTURES:
        raise ModelLoadError(f"{source}: text model_type {kind!r} is not supported (supported: "
                             f"{', '.join(TEXT_ARCHITECTURES)})")
    tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return ModelConfig.from_hf({**text, "architectures": [TEXT_ARCHITECTURES[kind]], "tie_word_embeddings": tie},
                               source=f"{source} text_config")


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
    config, tcfg = Idefics3Config.from_hf(hf, source), text_config(hf, source)
    tensors = SafetensorsDir(path)
    vision = Idefics3Vision.from_hf_tensors(config, WeightSource(tensors, source=str(path)), vision_dtype)
    try:
        text = DecoderLM.from_hf_tensors(tcfg, WeightSource(TextModelTensors(tensors), source=str(path)), options)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    pre = path / "preprocessor_config.json"
    return VisionLanguageModel(vision, text, config, tcfg, read_json(pre) if pre.is_file() else {})
