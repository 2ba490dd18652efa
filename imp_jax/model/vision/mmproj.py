"""llama.cpp's vision projector files (`--mmproj`): a CLIP GGUF (`general.architecture` "clip") read as the image
side of a GGUF text model, into the same vision modules an HF directory builds (model/vision/side.py).

What llama.cpp's converter writes (convert_hf_to_gguf.py --mmproj: conversion/smolvlm.py, qwenvl.py, gemma.py,
base.py's MmprojModel) is the spec. Three projector types (`clip.projector_type`):
- `idefics3` (Idefics3 / SmolVLM), beside a `llama` text GGUF: the SigLIP tower and the connector's one matrix,
  tensors renamed only. `clip.vision.preproc_image_size` is the first resize's longest edge; files from before the
  converter wrote it get 4 tiles a side (transformers' Idefics3 default; llama.cpp falls back to its generic
  resize there).
- `qwen2.5vl_merger` (Qwen2.5-VL), beside a `qwen2vl` text GGUF: the converter splits the fused q|k|v back into
  q, k, v and the Conv3d patch kernel [E, C, 2, p, p] into two Conv2d kernels (`v.patch_embd.weight` and
  `.weight.1`, the two frames); both are joined again here. Full-attention blocks are those i with
  (i + 1) % `clip.vision.n_wa_pattern` == 0, as llama.cpp's graph takes them. The file carries no window size:
  `clip.vision.window_size` when present, else llama.cpp's fixed 112 pixels. Nor the pixel bounds: the gguf keys
  `clip.vision.image_min_pixels` / `image_max_pixels` when present, else llama.cpp's (clip.cpp
  `set_limit_image_tokens(8, 4096)`: 8 to 4096 merged rows, i.e. x (patch * merge)^2 pixels; the HF
  preprocessor's own default is 4 to 1280). The merge size is `clip.vision.spatial_merge_size`, else 2; the
  tower's RMSNorm eps is fixed at 1e-6 as in transformers (real files carry that value).
- `gemma3` (Gemma 3), beside a `gemma3` text GGUF: the SigLIP tower (whole frames: SigLIP's own position table)
  and Gemma3MultiModalProjector's two tensors. `mm.input_projection.weight` is HF's `mm_input_projection_weight`
  as saved ([vision, text]; the converter only renames it, and always stores it float16); `mm.soft_emb_norm.weight`
  holds Gemma's RMSNorm scale 1 + w (the converter adds the 1; llama.cpp multiplies by it as stored), read back
  here as w. The projector's eps is the tower's (`clip.vision.attention.layer_norm_epsilon`), as in both llama.cpp
  and transformers. The file has no mm_tokens_per_image: llama.cpp average-pools k x k patches with k =
  `clip.vision.projector.scale_factor`, else its fixed 4 (every Gemma 3 size: 64 patches a side pooled to 16,
  256 rows per image), so mm_tokens_per_image = (image_size / patch_size / k)^2. Images are resized to
  `clip.vision.image_size` square with Pillow's bilinear filter, as transformers' Gemma3ImageProcessor does and
  an HF directory is served; llama.cpp's own preprocessing (same filter) letterboxes a non-square image with
  black bars instead of stretching it. The prompt is Gemma3Processor's: `<start_of_image>`, the rows'
  `<image_soft_token>`s, `<end_of_image>`, whose ids come from the text GGUF.
Tensor names go through gguf's own TensorNameMap (MODEL_ARCH.MMPROJ), as the converter's do. Image token ids and
the prompt's special tokens come from the text GGUF's tokenizer. Anything else (another projector type, a text
GGUF of another family, a projection width other than the text model's) is refused with one line.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from imp_jax.errors import ModelLoadError
from imp_jax.model.formats.gguf_loader import ARCHITECTURES, metadata_errors, open_gguf
from imp_jax.model.formats.gguf_metadata import Metadata, f32
from imp_jax.model.vision.gemma3 import Gemma3VisionConfig
from imp_jax.model.vision.gemma3_processor import (BOI_TOKEN, EOI_TOKEN, IMAGE_TOKEN as GEMMA_IMAGE_TOKEN,
                                                   Gemma3ProcessorConfig)
from imp_jax.model.vision.idefics3 import Idefics3Config
from imp_jax.model.vision.idefics3_processor import IMAGE_TOKEN, ImageProcessorConfig
from imp_jax.model.vision.qwen2_5_vl import Qwen25VisionConfig, Qwen25VLConfig
from imp_jax.model.vision.qwen2_5_vl_processor import (IMAGE_TOKEN as QWEN_IMAGE_TOKEN, VISION_END, VISION_START,
                                                       Qwen2VLProcessorConfig)
from imp_jax.model.vision.side import VisionCheckpoint
from imp_jax.model.vision.siglip import VisionConfig

# `clip.projector_type` -> the text GGUF architecture it pairs with
PROJECTORS = {"idefics3": "llama", "qwen2.5vl_merger": "qwen2vl", "gemma3": "gemma3"}
VIDEO_TOKEN = "<|video_pad|>"   # Qwen2.5-VL's config names it; images never use it
QWEN_WINDOW = 112          # pixels: llama.cpp's attention window for Qwen2.5-VL (clip.cpp)
QWEN_ROWS = (8, 4096)      # merged rows per image: llama.cpp's bounds for Qwen2.5-VL (clip.cpp)
IDEFICS3_TILES = 4         # tiles a side when the file lacks preproc_image_size (transformers' default)
GEMMA3_POOL = 4            # patches a side pooled into one row when the file lacks scale_factor (clip.cpp)
SOFT_EMB_NORM = "mm.soft_emb_norm.weight"   # Gemma 3's projector norm, stored as its scale 1 + w


def open_mmproj(path: str | Path, architecture: str, text_hidden: int, tokenizer: Any) -> VisionCheckpoint:
    """The image side in `path` for a text GGUF loaded as HF `architecture`, of width `text_hidden`, whose
    tokenizer holds the image tokens; a ModelLoadError (one line) for any file or pairing we do not serve."""
    path = Path(path)
    text_arch = {hf: name for name, hf in ARCHITECTURES.items()}.get(architecture, architecture)
    reader = open_gguf(path)
    with metadata_errors(path):
        meta = Metadata(reader, path)
        if meta.get("general.architecture") != "clip":
            raise ModelLoadError(f"--mmproj {path}: not a vision projector (general.architecture "
                                 f"{meta.get('general.architecture')!r}, expected 'clip')")
        kind = meta.get("clip.projector_type") or meta.get("clip.vision.projector_type")
        if kind not in PROJECTORS:
            raise ModelLoadError(f"--mmproj {path}: projector type {kind!r} is not supported (supported: "
                                 f"{', '.join(PROJECTORS)})")
        if PROJECTORS[kind] != text_arch:
            raise ModelLoadError(f"--mmproj {path}: a {kind} projector pairs with a '{PROJECTORS[kind]}' text "
                                 f"GGUF, not '{text_arch}'")
        width = int(meta.need("clip.vision.projection_dim"))
        if width != text_hidden:
            raise ModelLoadError(f"--mmproj {path}: projection width {width} differs from the text model's "
                                 f"hidden size {text_hidden}")
        raw = {t.name: t for t in reader.tensors}
        read, tokens = READERS[kind]
        config, processor = read(meta, raw, text_hidden, _token_ids(path, tokenizer, *tokens))
        blocks = config.vision.depth if kind == "qwen2.5vl_merger" else config.vision.num_layers
        return VisionCheckpoint(config, processor, MmprojTensors(raw, blocks, str(path)), str(path))


def _token_ids(path: Path, tokenizer: Any, *texts: str) -> list[int]:
    """The text GGUF's ids of the image prompt's special tokens `texts` (each must be in its vocabulary)."""
    ids = [tokenizer.token_to_id(t) for t in texts]
    missing = [t for t, i in zip(texts, ids) if i is None]
    if missing:
        raise ModelLoadError(f"--mmproj {path}: the text GGUF's vocabulary lacks {', '.join(missing)}")
    return ids


def _floats(meta: Metadata, key: str) -> tuple[float, ...]:
    return tuple(f32(x) for x in meta.need(key))


def _siglip(meta: Metadata, default_scale: int) -> tuple[VisionConfig, int]:
    """The SigLIP tower of an Idefics3 or Gemma 3 projector and its `clip.vision.projector.scale_factor` (else
    `default_scale`), which must divide the tower's patch side, as its heads must divide its width."""
    v = lambda key: meta.need(f"clip.vision.{key}")  # noqa: E731
    tower = VisionConfig(int(v("embedding_length")), int(v("feed_forward_length")), int(v("block_count")),
                         int(v("attention.head_count")), int(v("image_size")), int(v("patch_size")),
                         layer_norm_eps=f32(meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
                         hidden_act="gelu_pytorch_tanh")
    scale = int(meta.get("clip.vision.projector.scale_factor", default_scale))
    if scale < 1 or tower.patches_per_side % scale or tower.hidden_size % tower.num_heads:
        raise ModelLoadError(f"{meta.path}: scale factor {scale} must divide the {tower.patches_per_side}-patch "
                             f"side and {tower.num_heads} heads the width {tower.hidden_size}")
    return tower, scale


def _idefics3(meta: Metadata, raw: dict[str, Any], text_hidden: int, ids: list[int]
              ) -> tuple[Idefics3Config, ImageProcessorConfig]:
    """Idefics3 / SmolVLM: the SigLIP tower's shape, the shuffle factor and the tiling (module docstring)."""
    tower, scale = _siglip(meta, 2)
    longest = int(meta.get("clip.vision.preproc_image_size") or IDEFICS3_TILES * tower.image_size)
    processor = ImageProcessorConfig(longest_edge=longest, tile=tower.image_size,
                                     image_mean=_floats(meta, "clip.vision.image_mean"),
                                     image_std=_floats(meta, "clip.vision.image_std"))
    return Idefics3Config(tower, scale, text_hidden, ids[0]), processor


def _gemma3(meta: Metadata, raw: dict[str, Any], text_hidden: int, ids: list[int]
            ) -> tuple[Gemma3VisionConfig, Gemma3ProcessorConfig]:
    """Gemma 3: the SigLIP tower on whole frames, the rows per image from the pooling, one square frame per
    image (module docstring); `ids` are the image soft token's, `<start_of_image>`'s and `<end_of_image>`'s."""
    tower, pool = _siglip(meta, GEMMA3_POOL)
    tower = dataclasses.replace(tower, bucketed_positions=False)
    config = Gemma3VisionConfig(tower, (tower.patches_per_side // pool) ** 2, text_hidden, *ids)
    processor = Gemma3ProcessorConfig(size=tower.image_size, image_mean=_floats(meta, "clip.vision.image_mean"),
                                      image_std=_floats(meta, "clip.vision.image_std"))
    return config, processor


def _qwen(meta: Metadata, raw: dict[str, Any], text_hidden: int, ids: list[int]
          ) -> tuple[Qwen25VLConfig, Qwen2VLProcessorConfig]:
    """Qwen2.5-VL: the windowed ViT's shape, its full-attention blocks and the pixel bounds (module docstring)."""
    v = lambda key: meta.need(f"clip.vision.{key}")  # noqa: E731
    depth, pattern = int(v("block_count")), int(v("n_wa_pattern"))
    patch, merge = int(v("patch_size")), int(meta.get("clip.vision.spatial_merge_size", 2))
    if "v.patch_embd.weight.1" not in raw:
        raise ModelLoadError(f"{meta.path}: no second patch-embedding frame (v.patch_embd.weight.1); the "
                             "temporal patch size must be 2")
    if not meta.get("clip.use_silu"):
        raise ModelLoadError(f"{meta.path}: a Qwen2.5-VL projector without clip.use_silu (its MLP is SiLU)")
    if pattern < 1:
        raise ModelLoadError(f"{meta.path}: clip.vision.n_wa_pattern must be >= 1, got {pattern}")
    vision = Qwen25VisionConfig(
        depth, int(v("embedding_length")), int(v("feed_forward_length")), int(v("attention.head_count")), patch, 2,
        merge, int(meta.get("clip.vision.window_size", QWEN_WINDOW)),
        tuple(i for i in range(depth) if (i + 1) % pattern == 0), int(v("projection_dim")),
        int(raw["v.patch_embd.weight"].shape[2]), "silu")   # GGUF dims [p, p, C, E]
    if vision.hidden_size % vision.num_heads or vision.head_dim % 4 or vision.window_units < 1:
        raise ModelLoadError(f"{meta.path}: vision head_dim {vision.head_dim} must divide by 4 and the window "
                             f"{vision.window_size} px must cover a merge block")
    area = (patch * merge) ** 2
    processor = Qwen2VLProcessorConfig(
        min_pixels=int(meta.get("clip.vision.image_min_pixels") or QWEN_ROWS[0] * area),
        max_pixels=int(meta.get("clip.vision.image_max_pixels") or QWEN_ROWS[1] * area),
        patch_size=patch, temporal_patch_size=2, merge_size=merge,
        image_mean=_floats(meta, "clip.vision.image_mean"), image_std=_floats(meta, "clip.vision.image_std"))
    return Qwen25VLConfig(vision, *ids), processor


# `clip.projector_type` -> (its reader, the prompt's special tokens whose ids it takes from the text GGUF)
READERS = {"idefics3": (_idefics3, (IMAGE_TOKEN,)),
           "qwen2.5vl_merger": (_qwen, (QWEN_IMAGE_TOKEN, VISION_START, VISION_END, VIDEO_TOKEN)),
           "gemma3": (_gemma3, (GEMMA_IMAGE_TOKEN, BOI_TOKEN, EOI_TOKEN))}


class MmprojTensors(Mapping[str, np.ndarray]):
    """The file's tensors under the HF names our vision modules read (transformers' names, which gguf's
    TensorNameMap maps to the file's), dequantised to float32 on access; Qwen's `attn.qkv` and Conv3d
    `patch_embed.proj` joined from the pieces the converter split them into; Gemma 3's `mm_input_projection_weight`
    found as the converter names it (`.weight`) and its soft-emb norm's stored 1 + w read as w."""

    def __init__(self, raw: dict[str, Any], blocks: int, source: str):
        import gguf

        self._raw, self._source = raw, source
        self._names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, blocks)

    def _gguf_name(self, name: str) -> str | None:
        if name.endswith("_weight"):   # Gemma 3's projection parameter (conversion/gemma.py renames it so)
            name = name.removesuffix("_weight") + ".weight"
        return self._names.get_name(name, try_suffixes=(".weight", ".bias"))

    def _read(self, gguf_name: str) -> np.ndarray:
        from gguf.quants import dequantize

        t = self._raw[gguf_name]
        w = dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
        return np.require(w, np.float32, ["C", "W", "O"])

    def __getitem__(self, name: str) -> np.ndarray:
        if ".attn.qkv." in name:   # split q|k|v (conversion/qwenvl.py)
            return np.concatenate([self[name.replace(".qkv.", f".{x}.")] for x in "qkv"])
        gguf_name = self._gguf_name(name)
        if gguf_name is None or gguf_name not in self._raw:
            raise KeyError(name)
        if name.endswith("patch_embed.proj.weight"):   # Conv3d [E, C, 2, p, p] split into its two frames
            return np.stack([self._read(gguf_name), self._read(gguf_name + ".1")], axis=2)
        if gguf_name == SOFT_EMB_NORM:   # 1 + w; for a scale >= 0.5 the difference is exact, so the projector's
            # 1 + (that) is the stored scale bit for bit (w itself is back only to the scale's precision)
            return self._read(gguf_name) - np.float32(1)
        return self._read(gguf_name)

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        if ".attn.qkv." in name:
            return name.replace(".qkv.", ".q.") in self
        return self._gguf_name(name) in self._raw

    def __iter__(self) -> Iterator[str]:
        """The file's own names: many HF names map to one GGUF name, so only lookups speak HF."""
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)
