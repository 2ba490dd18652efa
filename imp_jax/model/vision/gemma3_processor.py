"""Gemma 3 image preprocessing and prompt text, in NumPy + Pillow (no jax, no torch).

Reproduces transformers' `Gemma3ImageProcessor` (its PIL backend, `Gemma3ImageProcessorPil`) with
pan-and-scan off, as transformers' Gemma3Processor defaults it: RGB (alpha over white), resize to
size x size with Pillow (BILINEAR by default) on uint8, rescale (float64 -> float32), normalise. Every image is
one frame, whatever its size or aspect ratio. An image stands for
"\\n\\n<start_of_image>" + mm_tokens_per_image x "<image_soft_token>" + "<end_of_image>\\n\\n" in the prompt:
`Gemma3Processor`'s `full_image_sequence`, which replaces the `<start_of_image>` the chat template writes.
Pan-and-scan (extra crops per image) is refused when a preprocessor_config.json turns it on.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from PIL import Image

from imp_jax.errors import ModelLoadError
from imp_jax.model.vision.idefics3_processor import normalize, to_rgb

BOI_TOKEN = "<start_of_image>"
EOI_TOKEN = "<end_of_image>"
IMAGE_TOKEN = "<image_soft_token>"


@dataclasses.dataclass(frozen=True)
class Gemma3ProcessorConfig:
    """The preprocessor_config.json fields Gemma 3 preprocessing reads (transformers' defaults)."""

    size: int = 224                                # the square side every image is resized to
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    resample: int = Image.Resampling.BILINEAR

    @property
    def tile(self) -> int:
        """The frame side (runtime/execution/image_encoder.py's name for it)."""
        return self.size

    @classmethod
    def from_hf(cls, hf: dict[str, Any], image_size: int, source: str = "preprocessor_config.json"
                ) -> "Gemma3ProcessorConfig":
        """From preprocessor_config.json; the frames must be the tower's `image_size` square, and pan-and-scan,
        which adds crops per image, is refused (a ModelLoadError) when it is turned on."""
        d, size = cls(), hf.get("size") or {"height": image_size, "width": image_size}
        pick = lambda key, default: hf[key] if hf.get(key) is not None else default
        if pick("do_pan_and_scan", False):
            raise ModelLoadError(f"{source}: do_pan_and_scan is on; Gemma 3's pan-and-scan crops are not "
                                 "supported (set it to false or null: each image is then one frame, as "
                                 "transformers' Gemma3Processor does by default)")
        try:
            side = (int(size["height"]), int(size["width"]))
            config = cls(side[0], bool(pick("do_resize", True)), bool(pick("do_rescale", True)),
                         float(pick("rescale_factor", d.rescale_factor)), bool(pick("do_normalize", True)),
                         tuple(pick("image_mean", d.image_mean)), tuple(pick("image_std", d.image_std)),
                         int(pick("resample", d.resample)))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ModelLoadError(f"{source}: bad value ({e!r})") from None
        if side != (image_size, image_size) or not config.do_resize:
            raise ModelLoadError(f"{source}: images must be resized to the tower's {image_size} x {image_size} "
                                 f"(size {size}, do_resize {config.do_resize})")
        return config


def preprocess(image: Image.Image, cfg: Gemma3ProcessorConfig) -> np.ndarray:
    """One image as the tower's frame: [3, size, size] float32."""
    return normalize(to_rgb(image).resize((cfg.size, cfg.size), resample=cfg.resample), cfg)


def image_prompt(mm_tokens_per_image: int) -> str:
    """The text that stands for one image (`Gemma3Processor.full_image_sequence`)."""
    return f"\n\n{BOI_TOKEN}{IMAGE_TOKEN * mm_tokens_per_image}{EOI_TOKEN}\n\n"
