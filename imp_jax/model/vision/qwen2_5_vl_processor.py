"""Qwen2.5-VL image preprocessing and prompt expansion, in NumPy + Pillow (no jax, no torch).

Reproduces transformers' `Qwen2VLImageProcessor` (its PIL backend): RGB (alpha over white), `smart_resize`
to sides that are multiples of patch * merge with the pixel count inside [min_pixels, max_pixels] (Pillow's
BICUBIC on uint8), rescale (float64 -> float32), normalise, then cut into patches laid out merge-block-major,
each patch flattened as [C, T, p, p] with the frame repeated T = temporal_patch_size times. An image of grid
(1, h, w) patches stands for t*h*w / merge^2 `<|image_pad|>` tokens between `<|vision_start|>` and
`<|vision_end|>` (the chat template writes one pad; `expand_prompt` repeats it, as `Qwen2_5_VLProcessor` does).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np
from PIL import Image

from imp_jax.model.vision.idefics3_processor import normalize, to_rgb

IMAGE_TOKEN = "<|image_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT = 200   # transformers refuses a more elongated image


@dataclasses.dataclass(frozen=True)
class Qwen2VLProcessorConfig:
    """The preprocessor_config.json fields Qwen2-VL / Qwen2.5-VL preprocessing reads (transformers' defaults)."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    do_convert_rgb: bool = True
    resample: int = Image.Resampling.BICUBIC

    @property
    def factor(self) -> int:
        """Both resized sides are multiples of this: a whole number of merge blocks."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "Qwen2VLProcessorConfig":
        """From preprocessor_config.json; `min_pixels`/`max_pixels` override `size`'s shortest/longest_edge."""
        d, size = cls(), hf.get("size") or {}
        pick = lambda key, default: hf[key] if hf.get(key) is not None else default
        return cls(int(pick("min_pixels", size.get("shortest_edge", d.min_pixels))),
                   int(pick("max_pixels", size.get("longest_edge", d.max_pixels))),
                   int(pick("patch_size", d.patch_size)), int(pick("temporal_patch_size", d.temporal_patch_size)),
                   int(pick("merge_size", d.merge_size)), bool(pick("do_resize", True)), bool(pick("do_rescale", True)),
                   float(pick("rescale_factor", d.rescale_factor)), bool(pick("do_normalize", True)),
                   tuple(pick("image_mean", d.image_mean)), tuple(pick("image_std", d.image_std)),
                   bool(pick("do_convert_rgb", True)), int(pick("resample", d.resample)))


@dataclasses.dataclass(frozen=True)
class ProcessedImages:
    """A request's images in prompt order: patches [sum of t*h*w, C*T*p*p] float32, concatenated, and each
    image's grid (t, h, w) in patches."""

    pixel_values: np.ndarray
    image_grid_thw: tuple[tuple[int, int, int], ...]


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(h, w) rounded to multiples of `factor`, then scaled (keeping the aspect) into [min_pixels, max_pixels]."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ValueError(f"an image's aspect ratio must be under {MAX_ASPECT}, got {width} x {height}")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def image_grid(width: int, height: int, cfg: Qwen2VLProcessorConfig) -> tuple[int, int, int]:
    """The grid (t, h, w) in patches of an image of this size, from its size alone (what its prompt needs)."""
    if cfg.do_resize:
        height, width = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    return 1, height // cfg.patch_size, width // cfg.patch_size


def patchify(frame: np.ndarray, cfg: Qwen2VLProcessorConfig) -> np.ndarray:
    """[C, H, W] -> [h*w, C*T*p*p]: patches merge-block-major, each [C, T, p, p] with the frame T times."""
    C, H, W = frame.shape
    p, m, T = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    if H % (p * m) or W % (p * m):
        raise ValueError(f"a {W} x {H} frame is not whole merge blocks of {p * m} pixels (do_resize off?)")
    x = frame.reshape(C, H // p // m, m, p, W // p // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], T, p, p))
    return x.reshape(H // p * (W // p), C * T * p * p)


def preprocess(images: Sequence[Image.Image], cfg: Qwen2VLProcessorConfig) -> ProcessedImages:
    """A request's images, in prompt order, as the tower's patches and grids."""
    patches, grids = [], []
    for image in images:
        img = to_rgb(image) if cfg.do_convert_rgb else image
        if cfg.do_resize:
            h, w = smart_resize(img.height, img.width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
            img = img.resize((w, h), resample=cfg.resample)
        patches.append(patchify(normalize(img, cfg), cfg))
        grids.append((1, img.height // cfg.patch_size, img.width // cfg.patch_size))
    return ProcessedImages(np.concatenate(patches), tuple(grids))


def image_prompt(grid: Sequence[int], merge_size: int) -> str:
    """The text that stands for one image: its pad tokens, one per embedding row, between start and end."""
    t, h, w = grid
    return VISION_START + IMAGE_TOKEN * (t * h * w // merge_size ** 2) + VISION_END


def expand_prompt(text: str, grids: Sequence[Sequence[int]], merge_size: int) -> str:
    """`text` with its i-th `<|image_pad|>` repeated for image i's rows; the counts must agree."""
    parts = text.split(IMAGE_TOKEN)
    if len(parts) - 1 != len(grids):
        raise ValueError(f"the prompt has {len(parts) - 1} {IMAGE_TOKEN} tokens for {len(grids)} images")
    out = [parts[0]]
    for (t, h, w), rest in zip(grids, parts[1:]):
        out += [IMAGE_TOKEN * (t * h * w // merge_size ** 2), rest]
    return "".join(out)
