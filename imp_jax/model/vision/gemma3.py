"""Gemma 3's image side: the SigLIP tower, then `Gemma3MultiModalProjector` into the text model's space.

Every image is one image_size x image_size frame (model/vision/gemma3_processor.py), so the tower gives an
n x n grid of patch rows (n = image_size / patch_size, position row i for patch i). The projector averages
each k x k block of that grid (k = n / sqrt(mm_tokens_per_image), `nn.AvgPool2d`), norms the pooled rows
with Gemma's RMSNorm (scale 1 + w, in float32, eps the tower's layer_norm_eps) and multiplies them by
`mm_input_projection_weight` [vision hidden, text hidden]: `mm_tokens_per_image` rows per image, the
embeddings that replace its `<image_soft_token>`s. They are not scaled by sqrt(hidden) as the text
embeddings are (transformers scatters them over the scaled embeddings; model/architectures/gemma.py does the same).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from imp_jax.errors import ModelLoadError
from imp_jax.model.architectures.gemma import GEMMA3_TEXT_DEFAULTS
from imp_jax.model.layers import linear, rms_norm
from imp_jax.model.vision.siglip import VisionConfig, VisionTransformer
from imp_jax.model.weights import WeightSource

ARCHITECTURES = ("Gemma3ForConditionalGeneration",)
# SiglipVisionConfig's defaults, which a saved `vision_config` may leave out
SIGLIP_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                       image_size=224, patch_size=16)
# where checkpoints keep the tower (the hub's; transformers 5's save; its module names) and the projector
TOWER_PREFIXES = ("vision_tower.vision_model.", "vision_tower.", "model.vision_tower.vision_model.")
PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")


@dataclasses.dataclass(frozen=True)
class Gemma3VisionConfig:
    """The image side of a Gemma 3 checkpoint: tower, rows per image, text width and the image tokens."""

    vision: VisionConfig
    mm_tokens_per_image: int
    text_hidden_size: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int

    @property
    def image_seq_len(self) -> int:
        """Embedding rows (and `<image_soft_token>`s) per image: one frame each."""
        return self.mm_tokens_per_image

    @property
    def pool(self) -> int:
        """The side of the square of patches the projector averages into one row."""
        return self.vision.patches_per_side // math.isqrt(self.mm_tokens_per_image)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> "Gemma3VisionConfig":
        """Parse the top-level config.json of a Gemma3ForConditionalGeneration (transformers' defaults)."""
        vision, text = hf.get("vision_config"), hf.get("text_config")
        if not isinstance(vision, dict) or not isinstance(text, dict):
            raise ModelLoadError(f"{source}: expected 'vision_config' and 'text_config' objects")
        tower = dataclasses.replace(VisionConfig.from_hf({**SIGLIP_DEFAULTS, **vision}, source),
                                    bucketed_positions=False)
        pick = lambda *keys, default: next((hf[k] for k in keys if hf.get(k) is not None), default)
        try:
            config = cls(tower, int(pick("mm_tokens_per_image", default=256)),
                         int(text.get("hidden_size", GEMMA3_TEXT_DEFAULTS["hidden_size"])),
                         int(pick("image_token_id", "image_token_index", default=262_144)),
                         int(pick("boi_token_id", "boi_token_index", default=255_999)),
                         int(pick("eoi_token_id", "eoi_token_index", default=256_000)))
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"{source}: bad value ({e})") from None
        side, n = math.isqrt(config.mm_tokens_per_image), tower.patches_per_side
        if side * side != config.mm_tokens_per_image or side == 0 or n % side:
            raise ModelLoadError(f"{source}: mm_tokens_per_image {config.mm_tokens_per_image} is not a square "
                                 f"whose side divides the tower's {n}-patch side")
        return config


class Gemma3Vision(nnx.Module):
    """Tower + projector: frames [N, C, S, S] (S = image_size) -> embedding rows [N, mm_tokens_per_image, text
    hidden]. `patch_mask` [N, S/p, S/p] is the tower's key mask; a Gemma 3 frame is whole (all True)."""

    def __init__(self, config: Gemma3VisionConfig, dtype: Any = jnp.float32):
        self.config, self.dtype = config, dtype
        E = config.vision.hidden_size
        self.tower = VisionTransformer(config.vision, dtype)
        self.norm = nnx.Param(jnp.zeros((E,), dtype))                           # Gemma's RMSNorm: scale 1 + w
        self.proj = nnx.Param(jnp.zeros((config.text_hidden_size, E), dtype))   # [out, in]: the saved one transposed

    def __call__(self, pixels: jax.Array, patch_mask: jax.Array) -> jax.Array:
        hidden = self.tower(pixels, patch_mask)
        return self.project(hidden)

    def project(self, hidden: jax.Array) -> jax.Array:
        """`Gemma3MultiModalProjector`: [N, n*n, E] patch rows -> [N, mm_tokens_per_image, text hidden]."""
        cfg = self.config
        N, _, E = hidden.shape
        n, k = cfg.vision.patches_per_side, cfg.pool
        grid = hidden.reshape(N, n // k, k, n // k, k, E)
        pooled = grid.astype(jnp.float32).mean(axis=(2, 4)).astype(hidden.dtype).reshape(N, (n // k) ** 2, E)
        normed = rms_norm(pooled, 1.0 + self.norm[...].astype(jnp.float32), cfg.vision.layer_norm_eps)
        return linear(normed, self.proj[...])

    @classmethod
    def from_hf_tensors(cls, config: Gemma3VisionConfig, weights: WeightSource,
                        dtype: Any = jnp.float32) -> "Gemma3Vision":
        """Build from the tower's and the projector's tensors under whichever of their prefixes the checkpoint
        uses (`TOWER_PREFIXES`, `PROJECTOR_PREFIXES`)."""
        tower = next((t for t in TOWER_PREFIXES if t + "post_layernorm.weight" in weights), TOWER_PREFIXES[0])
        projector = next((p for p in PROJECTOR_PREFIXES if p + "mm_soft_emb_norm.weight" in weights),
                         PROJECTOR_PREFIXES[0])
        model = nnx.eval_shape(lambda: cls(config, dtype))
        model.tower = VisionTransformer.from_hf_tensors(config.vision, weights, tower, dtype)
        for param, name in ((model.norm, "mm_soft_emb_norm.weight"), (model.proj, "mm_input_projection_weight")):
            value = weights.tensor(projector + name)
            value = value.T if value.ndim == 2 else value   # saved [vision, text], used as [text, vision]
            if value.shape != tuple(param.shape):
                raise ModelLoadError(f"{weights.source}: {projector}{name} has shape {value.shape}, "
                                     f"expected {param.shape}")
            param.set_value(jnp.asarray(value, dtype))
        return model
