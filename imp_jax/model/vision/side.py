"""An image-text checkpoint's image side as the main loader sees it (model/formats/loader.py): opened with the
checkpoint, built next to its text model, and exposed as `LoadedModel.vision` (None: text only).

Three families:
- Idefics3 / SmolVLM: transformers saves `model.vision_model.*`, `model.connector.*`, `model.text_model.*` and
  `lm_head.weight`; the text model is a plain Llama, so `DecoderLM` reads it through `TextModelTensors`, a
  view that drops `text_model.`. Every frame gives `config.image_seq_len` rows.
- Qwen2.5-VL: `visual.*` beside a Qwen2 text model under `model.*` (as the hub has it and transformers 5
  saves it; `model.language_model.*` is read through the same view). An image of grid (t, h, w) gives
  `config.rows(grid)` rows, and the decoder takes M-RoPE positions [3, T] (model/vision/qwen2_5_vl.py).
- Gemma 3: `vision_tower.*` and `multi_modal_projector.*` beside `language_model.model.*` (model/architectures/gemma.py reads
  it); every image is one frame of `config.image_seq_len` (mm_tokens_per_image) rows (model/vision/gemma3.py).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from imp_jax.errors import ModelLoadError
from imp_jax.model.config import read_json
from imp_jax.model.vision import gemma3, idefics3, qwen2_5_vl
from imp_jax.model.vision.gemma3 import Gemma3Vision, Gemma3VisionConfig
from imp_jax.model.vision.gemma3_processor import Gemma3ProcessorConfig
from imp_jax.model.vision.idefics3 import Idefics3Config, Idefics3Vision
from imp_jax.model.vision.idefics3_processor import ImageProcessorConfig
from imp_jax.model.vision.qwen2_5_vl import Qwen25Vision, Qwen25VLConfig
from imp_jax.model.vision.qwen2_5_vl_processor import Qwen2VLProcessorConfig
from imp_jax.model.weights import WeightSource

VisionConfig = Idefics3Config | Qwen25VLConfig | Gemma3VisionConfig
ProcessorConfig = ImageProcessorConfig | Qwen2VLProcessorConfig | Gemma3ProcessorConfig


class TextModelTensors(Mapping[str, np.ndarray]):
    """The text model's tensors under the names a causal LM has: `model.text_model.X` (or another
    `prefix`) as `model.X`."""

    def __init__(self, tensors: Mapping[str, np.ndarray], prefix: str = "model.text_model."):
        self._tensors = tensors
        self._prefix = prefix

    def _name(self, name: str) -> str:
        return self._prefix + name[len("model."):] if name.startswith("model.") else name

    def __getitem__(self, name: str) -> np.ndarray:
        return self._tensors[self._name(name)]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._name(name) in self._tensors

    def __iter__(self) -> Iterator[str]:
        pre = self._prefix
        return (("model." + k[len(pre):]) if k.startswith(pre) else k for k in self._tensors
                if k.startswith(pre) or not k.startswith("model."))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def vision_family(config: VisionConfig) -> str:
    """"idefics3" (Idefics3, SmolVLM), "qwen2_5_vl" or "gemma3": the family an image side's config is of."""
    if isinstance(config, Gemma3VisionConfig):
        return "gemma3"
    return "qwen2_5_vl" if isinstance(config, Qwen25VLConfig) else "idefics3"


@dataclasses.dataclass
class VisionCheckpoint:
    """The image side on disk, opened: configs read, the (whole checkpoint's) tensors not yet read."""

    config: VisionConfig
    processor: ProcessorConfig
    tensors: Mapping[str, np.ndarray]
    source: str

    @property
    def family(self) -> str:
        return vision_family(self.config)


@dataclasses.dataclass
class LoadedVision:
    """What turns a request's images into embedding rows, for either family (module docstring): the
    rows replace the prompt's `config.image_token_id` tokens, in order.
    - Idefics3 / SmolVLM: `encoder(pixels, patch_mask)` gives [frames, config.image_seq_len, hidden];
    - Qwen2.5-VL: `encoder(patches, *VisionLayout arrays)` gives [patches / merge^2, hidden], image i's
      `config.rows(grid_i)` of them in turn; its prompt also needs M-RoPE positions (vision/mrope.py);
    - Gemma 3: `encoder(pixels, patch_mask)` gives [images, config.image_seq_len, hidden], one frame each."""

    encoder: Idefics3Vision | Qwen25Vision | Gemma3Vision
    config: VisionConfig
    processor: ProcessorConfig   # preprocessor_config.json (transformers' defaults when absent)

    @property
    def family(self) -> str:
        return vision_family(self.config)


def is_vision_language(architecture: str) -> bool:
    """Whether an HF architecture name is an image-text model whose image side we load."""
    return any(architecture in m.ARCHITECTURES for m in (idefics3, qwen2_5_vl, gemma3))


def text_tensors(tensors: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
    """The view of an image-text checkpoint's tensors that its decoder reads as `model.*`."""
    for prefix in ("model.text_model.", "model.language_model."):
        if prefix + "embed_tokens.weight" in tensors:
            return TextModelTensors(tensors, prefix)
    return tensors   # Qwen2.5-VL as the hub has it: the text model is `model.*` already


def describe_vision(config: VisionConfig) -> str:
    """One line on the image side, for the load log."""
    if isinstance(config, Qwen25VLConfig):
        return config.describe()
    if isinstance(config, Gemma3VisionConfig):
        return (f"{config.vision.num_layers}-layer tower, {config.image_seq_len} rows per "
                f"{config.vision.image_size}-pixel image")
    return (f"{config.vision.num_layers}-layer tower, {config.image_seq_len} rows per "
            f"{config.vision.image_size}-pixel frame")


def open_vision(path: Path, hf: dict[str, Any], tensors: Mapping[str, np.ndarray]) -> VisionCheckpoint:
    """Read the image side's settings of the HF directory `path` (config.json parsed as `hf`)."""
    pre, proc = path / "preprocessor_config.json", path / "processor_config.json"
    if (hf.get("architectures") or [None])[0] in qwen2_5_vl.ARCHITECTURES:
        config = Qwen25VLConfig.from_hf(hf, str(path / "config.json"))
        try:
            processor = Qwen2VLProcessorConfig.from_hf(_json_object(pre))
        except (TypeError, ValueError, AttributeError) as e:
            raise ModelLoadError(f"{pre}: bad value ({e})") from None
        v = config.vision
        if (processor.patch_size, processor.merge_size, processor.temporal_patch_size) != (
                v.patch_size, v.spatial_merge_size, v.temporal_patch_size):
            raise ModelLoadError(f"{pre}: patch/merge/temporal sizes {processor.patch_size}/{processor.merge_size}/"
                                 f"{processor.temporal_patch_size} differ from the tower's {v.patch_size}/"
                                 f"{v.spatial_merge_size}/{v.temporal_patch_size}")
        return VisionCheckpoint(config, processor, tensors, str(path))
    if (hf.get("architectures") or [None])[0] in gemma3.ARCHITECTURES:
        config = Gemma3VisionConfig.from_hf(hf, str(path / "config.json"))
        processor = Gemma3ProcessorConfig.from_hf(_json_object(pre), config.vision.image_size, str(pre))
        seq_len = _json_object(proc).get("image_seq_length")
        if seq_len is not None and seq_len != config.image_seq_len:
            raise ModelLoadError(f"{proc}: image_seq_length {seq_len}, but the projector gives "
                                 f"{config.image_seq_len} rows per image (mm_tokens_per_image)")
        return VisionCheckpoint(config, processor, tensors, str(path))
    config = Idefics3Config.from_hf(hf, str(path / "config.json"))
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
    """The encoder built from the checkpoint: Idefics3's `model.vision_model.*` / `model.connector.*`, or
    Qwen2.5-VL's `visual.*`, or Gemma 3's `model.vision_tower.*` / `model.multi_modal_projector.*`."""
    weights = WeightSource(ckpt.tensors, source=ckpt.source)
    if isinstance(ckpt.config, Gemma3VisionConfig):
        return LoadedVision(Gemma3Vision.from_hf_tensors(ckpt.config, weights, dtype), ckpt.config, ckpt.processor)
    if isinstance(ckpt.config, Qwen25VLConfig):
        return LoadedVision(Qwen25Vision.from_hf_tensors(ckpt.config, weights, dtype), ckpt.config, ckpt.processor)
    return LoadedVision(Idefics3Vision.from_hf_tensors(ckpt.config, weights, dtype), ckpt.config, ckpt.processor)
