"""The SigLIP vision transformer as Idefics3 / SmolVLM use it (transformers' `Idefics3VisionTransformer`), and
as Gemma 3 uses it (`SiglipVisionTransformer`: whole image_size frames, `bucketed_positions` off).

A batch of N frames [N, C, H, W] (tiles of one or more images, padded to one size) and their
patch mask [N, H/p, W/p] (False: a patch of padding) give one row per patch [N, h*w, hidden]:
patch embedding (the stride-p conv as one matmul over flattened patches), learned position
embeddings looked up through NaViT-style bucketed ids (so a partial grid of any size maps onto the
table's `image_size / patch_size` square), pre-LN encoder layers (attention masks out padding
patches as keys), a final LayerNorm. Shapes are static: compile once per (N, H, W) bucket.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from imp_jax.errors import ModelLoadError
from imp_jax.model.layers import layer_norm, linear
from imp_jax.model.weights import WeightSource

ACTIVATIONS = {"gelu_pytorch_tanh": True, "gelu_fast": True, "gelu_new": True, "gelu": False}   # -> tanh approximation


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """Shape and numerics of the vision tower, from HF config.json's `vision_config`."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    bucketed_positions: bool = True   # False: SigLIP's own table lookup, patch i reads row i (full frames only)

    @property
    def patches_per_side(self) -> int:
        """The side of the position table's square grid."""
        return self.image_size // self.patch_size

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> "VisionConfig":
        """Parse `vision_config` (transformers' defaults for absent fields); a bad field is a ModelLoadError."""
        try:
            config = cls(int(hf.get("hidden_size", 1152)), int(hf.get("intermediate_size", 3072)),
                         int(hf.get("num_hidden_layers", 12)), int(hf.get("num_attention_heads", 16)),
                         int(hf.get("image_size", 224)), int(hf.get("patch_size", 32)),
                         int(hf.get("num_channels", 3)), float(hf.get("layer_norm_eps", 1e-6)),
                         str(hf.get("hidden_act", "gelu_pytorch_tanh")))
        except (TypeError, ValueError, AttributeError) as e:
            raise ModelLoadError(f"{source}: bad value in vision_config ({e})") from None
        if config.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(f"{source}: vision hidden_act {config.hidden_act!r} is not supported "
                                 f"(supported: {', '.join(ACTIVATIONS)})")
        if config.hidden_size % config.num_heads:
            raise ModelLoadError(f"{source}: vision hidden_size {config.hidden_size} is not a multiple of "
                                 f"num_attention_heads {config.num_heads}")
        return config


def position_boundaries(patches_per_side: int) -> np.ndarray:
    """The bucket edges 1/n, 2/n, ... < 1 as float32, computed as torch.arange does (in float64)."""
    return np.arange(1 / patches_per_side, 1.0, 1 / patches_per_side).astype(np.float32)


def position_ids(patch_mask: jax.Array, patches_per_side: int) -> jax.Array:
    """Each patch's row in the position table [N, h*w]: its fractional coordinate within the frame's
    valid h_n x w_n grid, bucketed onto the n x n table; padding patches read row 0 (transformers'
    `Idefics3VisionEmbeddings`, in the same float32 steps)."""
    N, h, w = patch_mask.shape
    edges = jnp.asarray(position_boundaries(patches_per_side))
    rows = jnp.sum(patch_mask[:, :, 0], axis=1).astype(jnp.float32)   # valid patches down the first column
    cols = jnp.sum(patch_mask[:, 0, :], axis=1).astype(jnp.float32)

    def buckets(n: jax.Array, size: int) -> jax.Array:
        frac = jnp.arange(size, dtype=jnp.float32)[None, :] * (jnp.float32(1.0) / n)[:, None]
        frac = jnp.minimum(frac, jnp.float32(1.0 - 1e-6))
        return jnp.searchsorted(edges, frac.reshape(-1), side="right").reshape(N, size)

    ids = buckets(rows, h)[:, :, None] * patches_per_side + buckets(cols, w)[:, None, :]
    return jnp.where(patch_mask, ids, 0).reshape(N, h * w).astype(jnp.int32)


def patchify(pixels: jax.Array, patch: int) -> jax.Array:
    """[N, C, H, W] -> [N, (H/p)*(W/p), C*p*p], each patch flattened in the conv weight's (C, y, x) order."""
    N, C, H, W = pixels.shape
    x = pixels.reshape(N, C, H // patch, patch, W // patch, patch)
    return x.transpose(0, 2, 4, 1, 3, 5).reshape(N, (H // patch) * (W // patch), C * patch * patch)


class VisionLayer(nnx.Module):
    """One pre-LayerNorm encoder layer; q|k|v fused into one [3E, E] projection."""

    def __init__(self, cfg: VisionConfig, dtype: Any):
        E, I = cfg.hidden_size, cfg.intermediate_size
        z = lambda *shape: nnx.Param(jnp.zeros(shape, dtype))
        self.ln1_w, self.ln1_b = z(E), z(E)
        self.qkv_w, self.qkv_b = z(3 * E, E), z(3 * E)
        self.o_w, self.o_b = z(E, E), z(E)
        self.ln2_w, self.ln2_b = z(E), z(E)
        self.fc1_w, self.fc1_b = z(I, E), z(I)
        self.fc2_w, self.fc2_b = z(E, I), z(E)

    def __call__(self, x: jax.Array, bias: jax.Array, cfg: VisionConfig) -> jax.Array:
        N, S, E = x.shape
        H = cfg.num_heads
        D = E // H
        h = layer_norm(x, self.ln1_w[...], self.ln1_b[...], cfg.layer_norm_eps)
        qkv = linear(h, self.qkv_w[...], self.qkv_b[...]).reshape(N, S, 3, H, D)
        ctx = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], bias=bias.astype(x.dtype),
                                           scale=D ** -0.5).reshape(N, S, E)
        x = x + linear(ctx, self.o_w[...], self.o_b[...])
        h = layer_norm(x, self.ln2_w[...], self.ln2_b[...], cfg.layer_norm_eps)
        h = jax.nn.gelu(linear(h, self.fc1_w[...], self.fc1_b[...]), approximate=ACTIVATIONS[cfg.hidden_act])
        return x + linear(h, self.fc2_w[...], self.fc2_b[...])


class VisionTransformer(nnx.Module):
    """The SigLIP tower (module docstring); build it with `from_hf_tensors`."""

    def __init__(self, config: VisionConfig, dtype: Any = jnp.float32):
        c = config
        self.config, self.dtype = config, dtype
        z = lambda *shape: nnx.Param(jnp.zeros(shape, dtype))
        self.patch_w = z(c.hidden_size, c.num_channels * c.patch_size ** 2)   # the conv weight, flattened
        self.patch_b = z(c.hidden_size)
        self.position = z(c.patches_per_side ** 2, c.hidden_size)
        self.layers = nnx.List([VisionLayer(c, dtype) for _ in range(c.num_layers)])
        self.post_ln_w, self.post_ln_b = z(c.hidden_size), z(c.hidden_size)

    def __call__(self, pixels: jax.Array, patch_mask: jax.Array) -> jax.Array:
        """Hidden states [N, h*w, hidden] of frames [N, C, H, W] with their patch mask [N, h, w] (bool).
        Without `bucketed_positions` (Gemma 3's SigLIP) every frame is image_size square and patch i reads
        position row i, as `SiglipVisionEmbeddings` does."""
        cfg = self.config
        x = linear(patchify(pixels.astype(self.dtype), cfg.patch_size), self.patch_w[...], self.patch_b[...])
        if cfg.bucketed_positions:
            x = x + self.position[...][position_ids(patch_mask, cfg.patches_per_side)]
        else:
            x = x + self.position[...][None]
        keys = patch_mask.reshape(patch_mask.shape[0], -1)
        bias = jnp.where(keys, 0.0, -1e30).astype(jnp.float32)[:, None, None, :]   # [N, 1, 1, S] over keys
        for layer in self.layers:
            x = layer(x, bias, cfg)
        return layer_norm(x, self.post_ln_w[...], self.post_ln_b[...], cfg.layer_norm_eps)

    @classmethod
    def from_hf_tensors(cls, config: VisionConfig, weights: WeightSource, prefix: str = "model.vision_model.",
                        dtype: Any = jnp.float32) -> "VisionTransformer":
        """Build from HF-named tensors under `prefix` (`Idefics3VisionTransformer`'s names)."""
        model = nnx.eval_shape(lambda: cls(config, dtype))

        def put(param: nnx.Param, *names: str, shape: tuple[int, ...] | None = None) -> None:
            parts = [weights.tensor(prefix + n) for n in names]
            value = parts[0] if len(parts) == 1 else np.concatenate(parts)
            if shape is not None and value.size == int(np.prod(shape)):
                value = value.reshape(shape)
            if value.shape != tuple(param.shape):
                raise ModelLoadError(f"{weights.source}: {prefix}{names[0]} has shape {value.shape}, "
                                     f"expected {param.shape}")
            param.set_value(jnp.asarray(value, dtype))

        put(model.patch_w, "embeddings.patch_embedding.weight", shape=tuple(model.patch_w.shape))
        put(model.patch_b, "embeddings.patch_embedding.bias")
        put(model.position, "embeddings.position_embedding.weight")
        put(model.post_ln_w, "post_layernorm.weight")
        put(model.post_ln_b, "post_layernorm.bias")
        for i, layer in enumerate(model.layers):
            p = f"encoder.layers.{i}."
            put(layer.ln1_w, p + "layer_norm1.weight")
            put(layer.ln1_b, p + "layer_norm1.bias")
            put(layer.qkv_w, *(f"{p}self_attn.{n}_proj.weight" for n in "qkv"))
            put(layer.qkv_b, *(f"{p}self_attn.{n}_proj.bias" for n in "qkv"))
            put(layer.o_w, p + "self_attn.out_proj.weight")
            put(layer.o_b, p + "self_attn.out_proj.bias")
            put(layer.ln2_w, p + "layer_norm2.weight")
            put(layer.ln2_b, p + "layer_norm2.bias")
            put(layer.fc1_w, p + "mlp.fc1.weight")
            put(layer.fc1_b, p + "mlp.fc1.bias")
            put(layer.fc2_w, p + "mlp.fc2.weight")
            put(layer.fc2_b, p + "mlp.fc2.bias")
        return model
