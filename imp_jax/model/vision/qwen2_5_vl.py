"""Qwen2.5-VL's image side: the windowed ViT and its patch merger (transformers' `Qwen2_5_VisionTransformer...`).

An image arrives as flat patches [n, C*T*p*p] (qwen2_5_vl_processor.py; T copies of the frame, patches laid
out merge-block-major) with its grid (t, h, w) in patches; it leaves as t*h*w / merge^2 rows of the text
model's width, one per `<|image_pad|>` token. Inside: the Conv3d patch embedding as one matmul, a 2D rotary
embedding (each patch's row and column, half the rotated dims each), pre-RMSNorm blocks with a SwiGLU MLP,
attention within windows of `window_size` pixels except in `fullatt_block_indexes` (within the whole
frame), and the merger (RMSNorm, each merge x merge block of patches concatenated, Linear-GELU-Linear).

transformers permutes the patches into window order, attends over contiguous windows (cu_seqlens) and
permutes the merged rows back. Attention does not care where a token sits, only which tokens share its
window, so here the patches stay in the processor's order: `VisionLayout` (host, NumPy) lists each window's
patches (`windows` [num_windows, window_len], the concatenation of the lists being transformers'
`window_index`) and each patch's frame (`segments`), the window layers gather a window's q/k/v, attend
and scatter back; the full layers attend under a same-frame mask (queries in chunks: memory H x chunk x N).
Several images of different sizes go in one call, concatenated; the full layers then spend N^2 work across
them where transformers spends sum(n_i^2), so large images are cheaper one per call.

What the engine must do for this family (not wired here; runtime/ owns it):
- images: preprocess each (qwen2_5_vl_processor.preprocess), build `VisionLayout.of(grids, ...)` padded to a
  patch bucket (`num_patches`, a multiple of merge^2) and a window bucket (`num_windows`), run the encoder
  once per bucket shape; image i owns rows [sum(rows of images < i), +rows_i) of the output, rows_i =
  t*h*w / merge^2, a count that varies per image (the prompt holds that many `<|image_pad|>` tokens);
- prefill: pass positions [3, T] (mrope.get_rope_index over the whole prompt, sliced per chunk) instead of
  [T]: temporal/height/width components differ on image tokens, all three equal on text;
- decode: the position of a token at sequence index i is i + delta (`get_rope_index`'s per-sequence delta,
  <= 0), the same in all three components, so [T] positions + delta work (no [3, T] needed there);
- the prefix cache must key image tokens by the image (the pad tokens are all the same id).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from imp_jax.errors import ModelLoadError
from imp_jax.model.layers import apply_rope, linear, rms_norm
from imp_jax.model.weights import WeightSource

ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration",)
ACTIVATIONS = {"silu": jax.nn.silu, "gelu": lambda x: jax.nn.gelu(x, approximate=False),
               "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True)}
NORM_EPS = 1e-6   # transformers hard-codes the tower's and the merger's RMSNorm eps
QUERY_CHUNK = 2048   # the full-attention blocks' queries per step (frame_attention)


@dataclasses.dataclass(frozen=True)
class Qwen25VisionConfig:
    """The ViT's shape (HF `vision_config`; transformers' defaults for absent fields)."""

    depth: int = 32
    hidden_size: int = 3584
    intermediate_size: int = 3420
    num_heads: int = 16
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    out_hidden_size: int = 3584
    in_channels: int = 3
    hidden_act: str = "silu"
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch: C * T * p * p."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def window_units(self) -> int:
        """A window's side in merge blocks (transformers' vit_merger_window_size)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @property
    def window_len(self) -> int:
        """Patches in a whole window: every window's list is padded to this."""
        return (self.window_units * self.spatial_merge_size) ** 2

    def rope_inv_freq(self) -> np.ndarray:
        """Inverse frequencies [head_dim // 4], shared by the row and the column angle."""
        half = self.head_dim // 2
        return 1.0 / (self.rope_theta ** (np.arange(0, half, 2, dtype=np.float64) / half))


@dataclasses.dataclass(frozen=True)
class Qwen25VLConfig:
    """The image side of a Qwen2.5-VL checkpoint: the ViT and the special tokens of an image's prompt text."""

    vision: Qwen25VisionConfig
    image_token_id: int = 151655
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    video_token_id: int = 151656

    def rows(self, grid_thw: Sequence[int]) -> int:
        """Embedding rows (and `<|image_pad|>` tokens) of an image of grid (t, h, w) patches."""
        t, h, w = grid_thw
        return t * h * w // self.vision.spatial_merge_size ** 2

    def describe(self) -> str:
        v = self.vision
        return (f"{v.depth}-layer windowed ViT (patch {v.patch_size}, merge {v.spatial_merge_size}, window "
                f"{v.window_size} px, full attention in blocks {list(v.fullatt_block_indexes)}), rows per image "
                f"t*h*w/{v.spatial_merge_size ** 2}")

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> "Qwen25VLConfig":
        """Parse the top-level config.json; a bad field is a ModelLoadError."""
        v = hf.get("vision_config")
        if not isinstance(v, dict):
            raise ModelLoadError(f"{source}: expected a 'vision_config' object")
        d, top = Qwen25VisionConfig(), cls(Qwen25VisionConfig())
        try:
            rope = v.get("rope_parameters") or {}
            vision = Qwen25VisionConfig(
                int(v.get("depth", d.depth)), int(v.get("hidden_size", d.hidden_size)),
                int(v.get("intermediate_size", d.intermediate_size)), int(v.get("num_heads", d.num_heads)),
                int(v.get("patch_size", d.patch_size)), int(v.get("temporal_patch_size", d.temporal_patch_size)),
                int(v.get("spatial_merge_size", d.spatial_merge_size)), int(v.get("window_size", d.window_size)),
                tuple(int(i) for i in v.get("fullatt_block_indexes", d.fullatt_block_indexes)),
                int(v.get("out_hidden_size", d.out_hidden_size)),
                int(v.get("in_channels", v.get("in_chans", d.in_channels))),   # the hub's configs: in_chans
                str(v.get("hidden_act", d.hidden_act)), float(rope.get("rope_theta", d.rope_theta)))
            config = cls(vision, *(int(hf.get(k, getattr(top, k))) for k in (
                "image_token_id", "vision_start_token_id", "vision_end_token_id", "video_token_id")))
        except (TypeError, ValueError, AttributeError) as e:
            raise ModelLoadError(f"{source}: bad value in vision_config ({e})") from None
        if vision.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(f"{source}: vision hidden_act {vision.hidden_act!r} is not supported "
                                 f"(supported: {', '.join(ACTIVATIONS)})")
        if vision.hidden_size % vision.num_heads or vision.head_dim % 4 or vision.window_units < 1:
            raise ModelLoadError(f"{source}: vision head_dim {vision.head_dim} must divide by 4 and window_size "
                                 f"{vision.window_size} must cover a merge block")
        return config


@dataclasses.dataclass(frozen=True)
class VisionLayout:
    """Where the patches of a call's images sit, all host arrays: `positions` [N, 2] each patch's (row,
    column) in its frame, `segments` [N] its frame (full attention stays inside it; -1: padding),
    `windows` [W, window_len] the patches of each window (N: none), `num_real` the real patches."""

    positions: np.ndarray
    segments: np.ndarray
    windows: np.ndarray
    num_real: int

    @classmethod
    def of(cls, grids: Sequence[Sequence[int]], vision: Qwen25VisionConfig, num_patches: int | None = None,
           num_windows: int | None = None) -> "VisionLayout":
        """The layout of images of `grids` (t, h, w) concatenated, padded to `num_patches` patches and
        `num_windows` windows (default: none added). Patches are in the processor's order: per frame,
        merge blocks row-major, each block's m x m patches row-major."""
        m, u = vision.spatial_merge_size, vision.window_units
        positions, segments, windows = [], [], []
        start, frame = 0, 0
        for t, h, w in grids:
            if h % m or w % m:
                raise ValueError(f"grid {(t, h, w)} does not divide by the merge size {m}")
            bh, bw = np.meshgrid(np.arange(h // m), np.arange(w // m), indexing="ij")   # merge blocks
            dy, dx = np.meshgrid(np.arange(m), np.arange(m), indexing="ij")
            rows = (bh[:, :, None, None] * m + dy).reshape(-1)
            cols = (bw[:, :, None, None] * m + dx).reshape(-1)
            block = np.arange(h * w).reshape(h // m, w // m, m * m)   # a frame's patch indices by block
            for _ in range(t):
                positions.append(np.stack([rows, cols], -1))
                segments.append(np.full(h * w, frame))
                for wy in range(0, h // m, u):
                    for wx in range(0, w // m, u):
                        windows.append(start + block[wy:wy + u, wx:wx + u].reshape(-1))
                start, frame = start + h * w, frame + 1
        N, W = num_patches or start, num_windows or len(windows)
        if N < start or W < len(windows) or N % (m * m):
            raise ValueError(f"{start} patches in {len(windows)} windows do not fit a bucket of {N} patches "
                             f"(a multiple of {m * m}) and {W} windows")
        pos = np.zeros((N, 2), np.int32)
        pos[:start] = np.concatenate(positions) if positions else pos[:0]
        seg = np.full(N, -1, np.int32)
        seg[:start] = np.concatenate(segments) if segments else seg[:0]
        win = np.full((W, vision.window_len), N, np.int32)
        for i, idx in enumerate(windows):
            win[i, :len(idx)] = idx
        return cls(pos, seg, win, start)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, keep: jax.Array) -> jax.Array:
    """Softmax attention of q, k, v [..., S, H, D] under `keep` [..., S, S] (a large negative where False:
    a row with no key left stays finite)."""
    scores = jnp.einsum("...qhd,...khd->...hqk", q, k, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    scores = jnp.where(keep[..., None, :, :], scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("...hqk,...khd->...qhd", probs, v, preferred_element_type=jnp.float32).astype(q.dtype)


def frame_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array,
                    chunk: int = QUERY_CHUNK) -> jax.Array:
    """Attention of q, k, v [N, H, D] within each frame (equal `segments`), `chunk` queries at a time: the
    scores take [H, chunk, N] rather than [H, N, N] (a 1280 x 1280 image has 8k patches)."""
    N = q.shape[0]
    if N <= chunk:
        return attention(q, k, v, segments[:, None] == segments[None, :])
    pad = -N % chunk
    qs = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(-1, chunk, *q.shape[1:])
    ss = jnp.pad(segments, (0, pad), constant_values=-2).reshape(-1, chunk)   # -2: a padding query, no key
    out = jax.lax.map(lambda a: attention(a[0], k, v, a[1][:, None] == segments[None, :]), (qs, ss))
    return out.reshape(-1, *q.shape[1:])[:N]


class VisionBlock(nnx.Module):
    """One pre-RMSNorm block: attention (q|k|v fused, biased), SwiGLU MLP (gate|up fused, biased)."""

    def __init__(self, c: Qwen25VisionConfig, dtype: Any):
        E, I = c.hidden_size, c.intermediate_size
        z = lambda *shape: nnx.Param(jnp.zeros(shape, dtype))
        self.norm1, self.norm2 = z(E), z(E)
        self.qkv_w, self.qkv_b = z(3 * E, E), z(3 * E)
        self.proj_w, self.proj_b = z(E, E), z(E)
        self.gate_up_w, self.gate_up_b = z(2 * I, E), z(2 * I)
        self.down_w, self.down_b = z(E, I), z(E)

    def __call__(self, x, cos, sin, c: Qwen25VisionConfig, windows: jax.Array | None, segments: jax.Array):
        """x [N, E]; `windows` [W, L] (window attention) or None (attention within each frame)."""
        N, E = x.shape
        h = rms_norm(x, self.norm1[...], NORM_EPS)
        qkv = linear(h, self.qkv_w[...], self.qkv_b[...]).reshape(N, 3, c.num_heads, c.head_dim)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if windows is None:
            ctx = frame_attention(q, k, v, segments)
        else:
            real = windows < N
            gather = lambda a: a[jnp.where(real, windows, 0)]   # [W, L, H, D]
            out = attention(gather(q), gather(k), gather(v), real[:, None, :] & real[:, :, None])
            ctx = jnp.zeros_like(q).at[windows.reshape(-1)].set(out.reshape(-1, *q.shape[1:]), mode="drop")
        x = x + linear(ctx.reshape(N, E), self.proj_w[...], self.proj_b[...])
        h = rms_norm(x, self.norm2[...], NORM_EPS)
        gate, up = jnp.split(linear(h, self.gate_up_w[...], self.gate_up_b[...]), 2, axis=-1)
        return x + linear(ACTIVATIONS[c.hidden_act](gate) * up, self.down_w[...], self.down_b[...])


class Qwen25Vision(nnx.Module):
    """Patches [N, C*T*p*p] and their `VisionLayout` -> embedding rows [N / merge^2, text hidden]."""

    def __init__(self, config: Qwen25VLConfig, dtype: Any = jnp.float32):
        c = config.vision
        self.config, self.dtype = config, dtype
        z = lambda *shape: nnx.Param(jnp.zeros(shape, dtype))
        unit = c.hidden_size * c.spatial_merge_size ** 2
        self.patch_w = z(c.hidden_size, c.patch_dim)   # the Conv3d weight, flattened (it has no bias)
        self.blocks = nnx.List([VisionBlock(c, dtype) for _ in range(c.depth)])
        self.merger_norm = z(c.hidden_size)
        self.merger_w1, self.merger_b1 = z(unit, unit), z(unit)
        self.merger_w2, self.merger_b2 = z(c.out_hidden_size, unit), z(c.out_hidden_size)

    def __call__(self, patches: jax.Array, positions: jax.Array, segments: jax.Array,
                 windows: jax.Array) -> jax.Array:
        """The rows of every merge block, in patch order (pass `VisionLayout`'s arrays; padding rows are
        finite garbage: keep the first num_real / merge^2)."""
        c = self.config.vision
        x = linear(patches.astype(self.dtype), self.patch_w[...])
        inv = jnp.asarray(self.config.vision.rope_inv_freq(), jnp.float32)
        angles = jnp.concatenate([positions[:, :1].astype(jnp.float32) * inv,
                                  positions[:, 1:].astype(jnp.float32) * inv], axis=-1)   # [N, head_dim / 2]
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, c, None if i in c.fullatt_block_indexes else windows, segments)
        x = rms_norm(x, self.merger_norm[...], NORM_EPS).reshape(-1, c.hidden_size * c.spatial_merge_size ** 2)
        x = jax.nn.gelu(linear(x, self.merger_w1[...], self.merger_b1[...]), approximate=False)
        return linear(x, self.merger_w2[...], self.merger_b2[...])

    def encode(self, patches: np.ndarray, grids: Sequence[Sequence[int]]) -> np.ndarray:
        """The rows of images `grids` whose patches are concatenated in `patches` (eager, unbucketed: tests, tools)."""
        layout = VisionLayout.of(grids, self.config.vision)
        arrays = (layout.positions, layout.segments, layout.windows)
        return np.asarray(self(jnp.asarray(patches), *(jnp.asarray(a) for a in arrays)))

    @classmethod
    def from_hf_tensors(cls, config: Qwen25VLConfig, weights: WeightSource, dtype: Any = jnp.float32,
                        prefix: str | None = None) -> "Qwen25Vision":
        """Build from `visual.*` (as transformers saves it; `model.visual.*` is read too)."""
        model = nnx.eval_shape(lambda: cls(config, dtype))
        if prefix is None:
            prefix = "visual." if "visual.patch_embed.proj.weight" in weights else "model.visual."

        def put(param: nnx.Param, *names: str) -> None:
            parts = [weights.tensor(prefix + n) for n in names]
            value = parts[0] if len(parts) == 1 else np.concatenate(parts)
            if value.size == int(np.prod(param.shape)) and value.ndim != len(param.shape):
                value = value.reshape(param.shape)   # the Conv3d kernel [E, C, T, p, p]
            if value.shape != tuple(param.shape):
                raise ModelLoadError(f"{weights.source}: {prefix}{names[0]} has shape {value.shape}, "
                                     f"expected {param.shape}")
            param.set_value(jnp.asarray(value, dtype))

        put(model.patch_w, "patch_embed.proj.weight")
        put(model.merger_norm, "merger.ln_q.weight")
        put(model.merger_w1, "merger.mlp.0.weight")
        put(model.merger_b1, "merger.mlp.0.bias")
        put(model.merger_w2, "merger.mlp.2.weight")
        put(model.merger_b2, "merger.mlp.2.bias")
        for i, b in enumerate(model.blocks):
            p = f"blocks.{i}."
            put(b.norm1, p + "norm1.weight")
            put(b.norm2, p + "norm2.weight")
            put(b.qkv_w, p + "attn.qkv.weight")
            put(b.qkv_b, p + "attn.qkv.bias")
            put(b.proj_w, p + "attn.proj.weight")
            put(b.proj_b, p + "attn.proj.bias")
            put(b.gate_up_w, p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
            put(b.gate_up_b, p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias")
            put(b.down_w, p + "mlp.down_proj.weight")
            put(b.down_b, p + "mlp.down_proj.bias")
        return model
