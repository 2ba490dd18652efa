"""An image-text checkpoint's image side as the main loader sees it (model/loader.py): opened with the
checkpoint, built next to its text model, and exposed as `LoadedModel.vision` (None: text only).

transformers saves `Idefics3ForConditionalGeneration` / `SmolVLMForConditionalGeneration` as
`model.vision_model.*`, `model.connector.*`, `model.text_model.*` and `lm_head.weight`; the text model
is a plain Llama, so `DecoderLM` reads it through `TextModelTensors`, a view that drops `text_model.`.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from imp_jax.errors import ModelLoadError
from imp_jax.model.config import read_json
from imp_jax.model.vision.idefics3 import ARCHITECTURES, Idefics3Config, Idefics3Vision
from imp_jax.model.vision.idefics3_processor import ImageProcessorConfig
from imp_jax.model.weights import WeightSource


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


@dataclasses.dataclass
class VisionCheckpoint:
    """The image side on disk, opened: configs read, the (whole checkpoint's) tensors not yet read."""

    config: Idefics3Config
    processor: ImageProcessorConfig
    tensors: Mapping[str, np.ndarray]
    source: str


@dataclasses.dataclass
class LoadedVision:
    """What turns a request's images into embedding rows: `encoder(pixels, patch_mask)` gives
    [frames, config.image_seq_len, hidden], the rows of its `<image>` tokens (config.image_token_id)."""

    encoder: Idefics3Vision
    config: Idefics3Config
    processor: ImageProcessorConfig   # preprocessor_config.json (transformers' defaults when absent)


def is_vision_language(architecture: str) -> bool:
    """Whether an HF architecture name is an image-text model whose image side we load."""
    return architecture in ARCHITECTURES


def open_vision(path: Path, hf: dict[str, Any], tensors: Mapping[str, np.ndarray]) -> VisionCheckpoint:
    """Read the image side's settings of the HF directory `path` (config.json parsed as `hf`)."""
    config = Idefics3Config.from_hf(hf, str(path / "config.json"))
    pre, proc = path / "preprocessor_config.json", path / "processor_config.json"
    try:
        processor = ImageProcessorConfig.from_hf(_json_object(pre))
    except (TypeError, ValueError, AttributeError) as e:
        raise ModelLoadError(f"{pre}: bad value ({e})") from None
    seq_len = _json_object(proc).get("image_seq_len")
    if seq_len is not None and seq_len != config.image_seq_len:
        raise ModelLoadError(f"{proc}: image_seq_len {seq_len}, but the connector gives "
                             f"{config.image_seq_len} rows per frame")
    return VisionCheckpoint(config, processor, tensors, str(path))


def _json_object(f: Path) -> dict[str, Any]:
    """A JSON file's object; {} when the file is absent."""
    if not f.is_file():
        return {}
    value = read_json(f)
    if not isinstance(value, dict):
        raise ModelLoadError(f"{f}: expected a JSON object")
    return value


def build_vision(ckpt: VisionCheckpoint, dtype: Any) -> LoadedVision:
    """The tower and connector built from the checkpoint's `model.vision_model.*` / `model.connector.*`."""
    encoder = Idefics3Vision.from_hf_tensors(ckpt.config, WeightSource(ckpt.tensors, source=ckpt.source), dtype)
    return LoadedVision(encoder, ckpt.config, ckpt.processor)
