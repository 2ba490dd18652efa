"""Idefics3 / SmolVLM image preprocessing and prompt expansion, in NumPy + Pillow (no jax, no torch).

Reproduces transformers' `Idefics3ImageProcessor` (its PIL backend; SmolVLM's is the same) step by
step: RGB (alpha over white), resize the longest edge to `size`, resize up to whole multiples of
`max_image_size`, cut that into row-major tiles and add the whole image resized to one tile (the
global image, last), all with Pillow's LANCZOS on uint8; then rescale (float64 -> float32),
normalise, and pad every frame to the batch's largest with a pixel mask. `expand_prompt` writes
the `<image>` layout of `Idefics3Processor`: per tile `<fake_token_around_image><row_r_col_c>` and
`image_seq_len` `<image>` tokens, a newline after each row of tiles, then the global image.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np
from PIL import Image

MAX_IMAGE_SIZE = 4096   # transformers' absolute cap on the resized image's longest edge
FAKE_TOKEN = "<fake_token_around_image>"
IMAGE_TOKEN = "<image>"
GLOBAL_TOKEN = "<global-img>"


@dataclasses.dataclass(frozen=True)
class ImageProcessorConfig:
    """The preprocessor_config.json fields Idefics3 / SmolVLM preprocessing reads (transformers' defaults)."""

    longest_edge: int = 4 * 364        # `size`: the first resize
    tile: int = 364                    # `max_image_size`: the side of every tile and of the global image
    do_resize: bool = True
    do_image_splitting: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    resample: int = Image.Resampling.LANCZOS

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ImageProcessorConfig":
        d = cls()
        size, tile = hf.get("size") or {}, hf.get("max_image_size") or {}
        return cls(int(size.get("longest_edge", d.longest_edge)), int(tile.get("longest_edge", d.tile)),
                   bool(hf.get("do_resize", True)), bool(hf.get("do_image_splitting", True)),
                   bool(hf.get("do_rescale", True)), float(hf.get("rescale_factor", d.rescale_factor)),
                   bool(hf.get("do_normalize", True)), tuple(hf.get("image_mean", d.image_mean)),
                   tuple(hf.get("image_std", d.image_std)), int(hf.get("resample", d.resample)))


@dataclasses.dataclass(frozen=True)
class ProcessedImages:
    """Frames of a request's images in prompt order, padded to one size: pixels [N, 3, H, W] float32, the
    pixel mask [N, H, W] (1 real, 0 padding), and each image's (rows, cols) of tiles ((0, 0): unsplit)."""

    pixel_values: np.ndarray
    pixel_attention_mask: np.ndarray
    grids: tuple[tuple[int, int], ...]

    @property
    def frames_per_image(self) -> tuple[int, ...]:
        return tuple(r * c + 1 if r or c else 1 for r, c in self.grids)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, an alpha channel (or a palette's transparency) composited over white, as transformers does."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """(h, w) with the longest edge `longest`, the other scaled and rounded up to even, then capped at 4096."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """(h, w) rounded up to whole tiles, the short side first rescaled by the long side's rounding."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def image_frames(image: Image.Image, cfg: ImageProcessorConfig) -> tuple[list[Image.Image], tuple[int, int]]:
    """One image's frames (its tiles row-major, then the global image) as RGB uint8 images, and its tile grid."""
    img = to_rgb(image)
    resize = lambda im, h, w: im.resize((w, h), resample=cfg.resample)
    if cfg.do_resize:
        img = resize(img, *longest_edge_size(img.height, img.width, cfg.longest_edge))
    if not cfg.do_image_splitting:
        return [resize(img, cfg.tile, cfg.tile)], (0, 0)
    img = resize(img, *tile_multiple_size(img.height, img.width, cfg.tile))
    if img.height <= cfg.tile and img.width <= cfg.tile:
        return [img], (0, 0)
    rows = (img.height - cfg.tile) // cfg.tile + 1
    cols = (img.width - cfg.tile) // cfg.tile + 1
    t = cfg.tile
    tiles = [img.crop((c * t, r * t, (c + 1) * t, (r + 1) * t)) for r in range(rows) for c in range(cols)]
    return tiles + [resize(img, t, t)], (rows, cols)


def image_grid(width: int, height: int, cfg: ImageProcessorConfig) -> tuple[int, int]:
    """The (rows, cols) of tiles `image_frames` cuts an image of this size into ((0, 0): one frame), from its
    size alone: what a prompt needs before any pixel is resized."""
    if not cfg.do_image_splitting:
        return 0, 0
    if cfg.do_resize:
        height, width = longest_edge_size(height, width, cfg.longest_edge)
    height, width = tile_multiple_size(height, width, cfg.tile)
    if height <= cfg.tile and width <= cfg.tile:
        return 0, 0
    return (height - cfg.tile) // cfg.tile + 1, (width - cfg.tile) // cfg.tile + 1


def normalize(frame: Image.Image, cfg: ImageProcessorConfig) -> np.ndarray:
    """[3, H, W] float32: rescaled in float64 then cast, normalised per channel in float32."""
    x = np.asarray(frame, np.uint8).transpose(2, 0, 1)
    x = (x.astype(np.float64) * cfg.rescale_factor).astype(np.float32) if cfg.do_rescale else x.astype(np.float32)
    if cfg.do_normalize:
        mean, std = np.asarray(cfg.image_mean, np.float32), np.asarray(cfg.image_std, np.float32)
        x = ((x.T - mean) / std).T
    return x


def preprocess(images: Sequence[Image.Image], cfg: ImageProcessorConfig) -> ProcessedImages:
    """A request's images, in prompt order, as the vision tower's frames (padded bottom-right to the largest)."""
    frames, grids = [], []
    for image in images:
        fs, grid = image_frames(image, cfg)
        frames.extend(normalize(f, cfg) for f in fs)
        grids.append(grid)
    H, W = max(f.shape[1] for f in frames), max(f.shape[2] for f in frames)
    pixels = np.zeros((len(frames), 3, H, W), np.float32)
    mask = np.zeros((len(frames), H, W), np.int64)
    for i, f in enumerate(frames):
        pixels[i, :, :f.shape[1], :f.shape[2]] = f
        mask[i, :f.shape[1], :f.shape[2]] = 1
    return ProcessedImages(pixels, mask, tuple(grids))


def image_prompt(grid: tuple[int, int], image_seq_len: int) -> str:
    """The text that stands for one image: its tiles' tokens row by row, then the global image's."""
    rows, cols = grid
    whole = f"{FAKE_TOKEN}{GLOBAL_TOKEN}{IMAGE_TOKEN * image_seq_len}{FAKE_TOKEN}"
    if rows == 0 and cols == 0:
        return whole
    lines = "".join("".join(f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{IMAGE_TOKEN * image_seq_len}"
                            for c in range(cols)) + "\n" for r in range(rows))
    return lines + "\n" + whole


def expand_prompt(text: str, grids: Sequence[tuple[int, int]], image_seq_len: int) -> str:
    """`text` with its i-th `<image>` replaced by image i's layout (`image_prompt`); the counts must agree."""
    parts = text.split(IMAGE_TOKEN)
    if len(parts) - 1 != len(grids):
        raise ValueError(f"the prompt has {len(parts) - 1} {IMAGE_TOKEN} tokens for {len(grids)} images")
    out = [parts[0]]
    for grid, rest in zip(grids, parts[1:]):
        out += [image_prompt(grid, image_seq_len), rest]
    return "".join(out)


def image_token_positions(input_ids: Sequence[int], image_token_id: int) -> np.ndarray:
    """Where the image embedding rows go: the positions of `image_token_id`, in order (one row each)."""
    return np.flatnonzero(np.asarray(input_ids) == image_token_id)
