"""Idefics3 / SmolVLM's image side: the SigLIP tower, then the connector into the text model's space.

The connector folds each s x s block of patch rows into one row (`pixel_shuffle`, transformers'
exact reshape order) and projects it with a bias-free linear, so a frame of n x n patches becomes
`image_seq_len` = n*n / s^2 rows of the text model's hidden size: the embeddings that replace that
frame's `<image>` tokens in the prompt, frame after frame, in the order the preprocessor emits them.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from imp_jax.errors import ModelLoadError
from imp_jax.model.layers import linear
from imp_jax.model.vision.siglip import VisionConfig, VisionTransformer
from imp_jax.model.weights import WeightSource

ARCHITECTURES = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")


@dataclasses.dataclass(frozen=True)
class Idefics3Config:
    """The image side of an Idefics3 / SmolVLM checkpoint: tower, shuffle factor, text width, image token."""

    vision: VisionConfig
    scale_factor: int
    text_hidden_size: int
    image_token_id: int

    @property
    def image_seq_len(self) -> int:
        """Embedding rows (and `<image>` tokens) per frame of image_size x image_size pixels."""
        return self.vision.patches_per_side ** 2 // self.scale_factor ** 2

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> "Idefics3Config":
        """Parse the top-level config.json of an Idefics3 / SmolVLM checkpoint."""
        vision, text = hf.get("vision_config"), hf.get("text_config")
        if not isinstance(vision, dict) or not isinstance(text, dict):
            raise ModelLoadError(f"{source}: expected 'vision_config' and 'text_config' objects")
        try:
            config = cls(VisionConfig.from_hf(vision, source), int(hf.get("scale_factor", 2)),
                         int(text["hidden_size"]), int(hf.get("image_token_id", 128257)))
        except KeyError as e:
            raise ModelLoadError(f"{source}: text_config is missing {e}") from None
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"{source}: bad value ({e})") from None
        if config.vision.patches_per_side % config.scale_factor:
            raise ModelLoadError(f"{source}: scale_factor {config.scale_factor} does not divide the "
                                 f"{config.vision.patches_per_side}-patch side")
        return config


def pixel_shuffle(x: jax.Array, s: int) -> jax.Array:
    """[N, n*n, E] -> [N, n*n / s^2, E * s^2], transformers' `Idefics3Connector.pixel_shuffle` step by step."""
    N, S, E = x.shape
    n = int(round(S ** 0.5))
    if n * n != S or n % s:
        raise ValueError(f"pixel_shuffle needs a square grid whose side divides by {s}, got {S} rows")
    x = x.reshape(N, n, n // s, E * s).transpose(0, 2, 1, 3)
    x = x.reshape(N, n // s, n // s, E * s * s).transpose(0, 2, 1, 3)
    return x.reshape(N, S // (s * s), E * s * s)


def patch_mask(pixel_mask: np.ndarray, patch: int) -> np.ndarray:
    """[N, H, W] pixel mask -> [N, H/p, W/p] bool: a patch counts when any of its pixels is real."""
    N, H, W = pixel_mask.shape
    m = np.asarray(pixel_mask).reshape(N, H // patch, patch, W // patch, patch)
    return m.sum(axis=(2, 4)) > 0


class Idefics3Vision(nnx.Module):
    """Tower + connector: frames [N, C, H, W] and patch mask -> embedding rows [N, image_seq_len, text hidden]."""

    def __init__(self, config: Idefics3Config, dtype: Any = jnp.float32):
        self.config, self.dtype = config, dtype
        self.tower = VisionTransformer(config.vision, dtype)
        s2 = config.scale_factor ** 2
        self.proj = nnx.Param(jnp.zeros((config.text_hidden_size, config.vision.hidden_size * s2), dtype))

    def __call__(self, pixels: jax.Array, patch_mask: jax.Array) -> jax.Array:
        """Each frame's rows for its `<image>` tokens; the frames must be square (the shuffle's grid)."""
        hidden = self.tower(pixels, patch_mask)
        return linear(pixel_shuffle(hidden, self.config.scale_factor), self.proj[...])

    @classmethod
    def from_hf_tensors(cls, config: Idefics3Config, weights: WeightSource,
                        dtype: Any = jnp.float32) -> "Idefics3Vision":
        """Build from `model.vision_model.*` and `model.connector.*` (names as transformers saves them)."""
        model = nnx.eval_shape(lambda: cls(config, dtype))
        model.tower = VisionTransformer.from_hf_tensors(config.vision, weights, "model.vision_model.", dtype)
        name = "model.connector.modality_projection.proj.weight"
        value = weights.tensor(name)
        if value.shape != tuple(model.proj.shape):
            raise ModelLoadError(f"{weights.source}: {name} has shape {value.shape}, expected {model.proj.shape}")
        model.proj.set_value(jnp.asarray(value, dtype))
        return model
