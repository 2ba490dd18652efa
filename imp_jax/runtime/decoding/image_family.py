"""What the images feature (runtime/features/images.py) needs to know of a vision family, behind one small
interface: how many prompt tokens (= encoder rows) an image stands for, from its size alone; how many pool
units of `unit` rows it takes; its host preprocessing; its encoder; its prompt text; and for an M-RoPE
family the prompt's [3, T] positions and decode delta.

- Idefics3 / SmolVLM: a unit is a frame of image_seq_len rows; an image is its frames (runtime/execution/image_encoder.py).
- Qwen2.5-VL: an image of grid (1, h, w) gives h*w / merge^2 rows, a count that varies per image, so a unit is
  QWEN_ROW_UNIT rows and an image takes ceil(rows / unit) of them (its last one partly unused);
  runtime/execution/image_encoder_qwen.py; positions from model/vision/mrope.py.
- Gemma 3: every image is one frame of mm_tokens_per_image rows, one unit (runtime/execution/image_encoder.py's frames);
  an image's tokens attend to each other both ways (`bidirectional`).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from PIL import Image

from imp_jax.model.vision import gemma3_processor as gemma3
from imp_jax.model.vision import idefics3_processor as idefics3
from imp_jax.model.vision import qwen2_5_vl_processor as qwen
from imp_jax.model.vision.mrope import get_rope_index
from imp_jax.model.vision.side import LoadedVision, VisionCheckpoint
from imp_jax.runtime.execution.image_encoder import ImageEncoder, frames_of, num_frames
from imp_jax.runtime.execution.image_encoder_qwen import QwenImageEncoder, pixels_of

QWEN_ROW_UNIT = 16   # pool rows per unit for Qwen2.5-VL: small images waste little, the bookkeeping stays short


def row_unit(vision: LoadedVision) -> int:
    """Rows per pool unit (slot) for this family."""
    return family_class(vision).unit_rows(vision)


def text_hidden(vision: LoadedVision) -> int:
    """The width of an encoder row (the text model's hidden size)."""
    return family_class(vision).row_width(vision)


class Idefics3Family:
    """Idefics3 / SmolVLM: frames of image_seq_len rows."""

    mrope = False
    bidirectional = False   # an image's tokens attend causally, like text (Gemma 3's see their whole image)

    @staticmethod
    def unit_rows(vision: LoadedVision) -> int:
        return vision.config.image_seq_len

    @staticmethod
    def row_width(vision: LoadedVision) -> int:
        return vision.config.text_hidden_size

    def __init__(self, vision: LoadedVision, num_units: int, step_tokens: int, mesh):
        self.vision, self.unit = vision, self.unit_rows(vision)
        self.image_token_id = vision.config.image_token_id
        cfg = vision.processor
        widest = num_frames(idefics3.image_grid(cfg.longest_edge, cfg.longest_edge, cfg))   # a full-size image
        step = -(-step_tokens // self.unit)   # the frames one step's tokens can cover
        self.encoder = ImageEncoder(vision, num_units, max(widest, step), mesh) if mesh is not None else None

    def num_rows(self, size: tuple[int, int]) -> int:
        return self.units(size) * self.unit

    def units(self, size: tuple[int, int]) -> int:
        return num_frames(idefics3.image_grid(*size, self.vision.processor))

    def prompt(self, size: tuple[int, int]) -> str:
        return idefics3.image_prompt(idefics3.image_grid(*size, self.vision.processor), self.unit)

    def pixels(self, pixels: np.ndarray) -> Any:
        return frames_of(pixels, self.vision)

    def positions(self, prompt_ids: Sequence[int], sizes: Sequence[tuple[int, int]]) -> None:
        return None

    def refusal(self, size: tuple[int, int]) -> str | None:
        return None   # any number of frames: past the largest bucket they go in several launches

    def encode(self, owner: Any, entries: list, rows: list[np.ndarray]) -> None:
        """Launch the encoder on the entries' frames, into their pool slots."""
        pixels = np.concatenate([e.pixels[0] for e in entries])
        mask = np.concatenate([e.pixels[1] for e in entries])
        slots = np.concatenate([np.asarray(e.slots, np.int32) for e in entries])
        self.encoder.encode(owner, pixels, mask, slots)


class Gemma3Family(Idefics3Family):
    """Gemma 3: one frame of mm_tokens_per_image rows per image, whatever its size; bidirectional within it."""

    bidirectional = True

    def __init__(self, vision: LoadedVision, num_units: int, step_tokens: int, mesh):
        self.vision, self.unit = vision, self.unit_rows(vision)
        self.image_token_id = vision.config.image_token_id
        step = -(-step_tokens // self.unit)   # the images one step's tokens can cover
        self.encoder = ImageEncoder(vision, num_units, max(1, step), mesh) if mesh is not None else None

    def units(self, size: tuple[int, int]) -> int:
        return 1

    def prompt(self, size: tuple[int, int]) -> str:
        return gemma3.image_prompt(self.unit)

    def pixels(self, pixels: np.ndarray) -> Any:
        """The image's one frame [1, 3, S, S] and its all-on patch mask."""
        frame = gemma3.preprocess(Image.fromarray(pixels, "RGB"), self.vision.processor)
        n = frame.shape[-1] // self.vision.config.vision.patch_size
        return frame[None], np.ones((1, n, n), bool)


class QwenFamily:
    """Qwen2.5-VL: h*w / merge^2 rows per image, M-RoPE positions."""

    mrope = True
    bidirectional = False

    @staticmethod
    def unit_rows(vision: LoadedVision) -> int:
        return QWEN_ROW_UNIT

    @staticmethod
    def row_width(vision: LoadedVision) -> int:
        return vision.config.vision.out_hidden_size

    def __init__(self, vision: LoadedVision, num_units: int, step_tokens: int, mesh):
        self.vision, self.unit = vision, self.unit_rows(vision)
        self.image_token_id = vision.config.image_token_id
        self.merge = vision.config.vision.spatial_merge_size
        p = vision.processor
        most = max(p.max_pixels, p.min_pixels, p.factor ** 2) // p.patch_size ** 2   # patches of a full-size image
        self.encoder = QwenImageEncoder(vision, num_units * self.unit, most, mesh) if mesh is not None else None

    def grid(self, size: tuple[int, int]) -> tuple[int, int, int]:
        return qwen.image_grid(*size, self.vision.processor)

    def num_rows(self, size: tuple[int, int]) -> int:
        return self.vision.config.rows(self.grid(size))

    def units(self, size: tuple[int, int]) -> int:
        return -(-self.num_rows(size) // self.unit)

    def prompt(self, size: tuple[int, int]) -> str:
        return qwen.image_prompt(self.grid(size), self.merge)

    def pixels(self, pixels: np.ndarray) -> Any:
        return pixels_of(pixels, self.vision)

    def positions(self, prompt_ids: Sequence[int], sizes: Sequence[tuple[int, int]]) -> tuple[np.ndarray, int]:
        """The prompt's M-RoPE positions [3, T] int32 and its decode delta (ValueError: the image tokens do not
        match the images)."""
        pos, delta = get_rope_index(prompt_ids, [self.grid(s) for s in sizes], self.image_token_id, self.merge)
        return pos.astype(np.int32), delta

    def refusal(self, size: tuple[int, int]) -> str | None:
        """Why the encoder cannot take an image of this size (None: it can): its patches must fit the largest
        bucket, a full-size image's (smart_resize can pass max_pixels for a very elongated image)."""
        t, h, w = self.grid(size)
        most = self.encoder.max_patches if self.encoder is not None else None
        if most is not None and t * h * w > most:
            return (f"a {size[0]} x {size[1]} image resizes to {t * h * w} patches; the encoder takes at most "
                    f"{most} (a less elongated image)")
        return None

    def encode(self, owner: Any, entries: list, rows: list[np.ndarray]) -> None:
        """Launch the tower on the entries' patches, image i's rows to pool rows `rows[i]`."""
        self.encoder.encode(owner, [e.pixels for e in entries], rows)


def image_family(vision: LoadedVision, num_units: int = 0, step_tokens: int = 0, mesh=None):
    """The family's adapter; with a `mesh`, its encoder too (built for a pool of `num_units` units)."""
    return family_class(vision)(vision, num_units, step_tokens, mesh)


def family_class(vision: LoadedVision | VisionCheckpoint) -> type[Idefics3Family] | type[QwenFamily]:
    """The one place a vision family name picks its adapter (for a loaded image side, or one opened only)."""
    return {"qwen2_5_vl": QwenFamily, "gemma3": Gemma3Family}.get(vision.family, Idefics3Family)
