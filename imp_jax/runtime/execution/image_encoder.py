"""The vision encoder as its own compiled program: frames in, their rows written straight into the row pool.

One program per frame-count bucket (powers of two up to `max_frames`), every frame a tile x tile square with
its patch mask (a smaller frame padded, its padding patches masked). The program takes the pool donated and
each frame's destination slot; a padding frame's slot is past the pool, so `mode="drop"` writes it nowhere.
All buckets compile at start-up; a launch is an asynchronous dispatch on the engine thread (the step that
reads the rows follows it on the device), and more frames than the largest bucket go in several launches.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from PIL import Image

from imp_jax.model.vision.idefics3 import patch_mask
from imp_jax.model.vision.idefics3_processor import image_frames, normalize
from imp_jax.model.vision.side import LoadedVision
from imp_jax.runtime.execution.batch import pow2_buckets
from imp_jax.runtime.parallel.sharding import replicated

Progress = Callable[[int, int, str, float], None]   # (i, n, bucket label, seconds)


def frames_of(pixels: np.ndarray, vision: LoadedVision) -> tuple[np.ndarray, np.ndarray]:
    """One image's frames (its tiles row-major, then the global image) as the encoder takes them: pixels
    [F, 3, tile, tile] float32 and the patch mask [F, tile/p, tile/p], smaller frames padded bottom-right."""
    cfg, p = vision.processor, vision.config.vision.patch_size
    frames = [normalize(f, cfg) for f in image_frames(Image.fromarray(pixels, "RGB"), cfg)[0]]
    side = max(cfg.tile, *(max(f.shape[1:]) for f in frames))
    out = np.zeros((len(frames), 3, side, side), np.float32)
    mask = np.zeros((len(frames), side, side), np.int64)
    for i, f in enumerate(frames):
        out[i, :, :f.shape[1], :f.shape[2]] = f
        mask[i, :f.shape[1], :f.shape[2]] = 1
    return out, patch_mask(mask, p)


def num_frames(grid: tuple[int, int]) -> int:
    """Frames of an image cut into `grid` (rows, cols) of tiles ((0, 0): one frame)."""
    return grid[0] * grid[1] + 1 if any(grid) else 1


class ImageEncoder:
    """The encoder's programs and parameters; writes into the `pool` it is given (CompiledStep.image_pool)."""

    def __init__(self, vision: LoadedVision, num_slots: int, max_frames: int, mesh):
        self.vision = vision
        self.rows_per_frame = L = vision.config.image_seq_len
        self.side = vision.processor.tile
        self.patches = self.side // vision.config.vision.patch_size
        self.num_slots = num_slots
        self.buckets = pow2_buckets(1, max(1, min(max_frames, num_slots)))
        graphdef, state = nnx.split(vision.encoder)
        leaves, treedef = jax.tree.flatten(state)
        rep = replicated(mesh)
        self._leaves = jax.device_put(leaves, rep)

        def encode(leaves, pool, pixels, mask, dest):
            encoder = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
            rows = encoder(pixels, mask)                                   # [N, L, hidden]
            slots = pool.reshape(pool.shape[0] // L, L, pool.shape[1])
            return slots.at[dest].set(rows.astype(pool.dtype), mode="drop").reshape(pool.shape)

        self._jit = jax.jit(encode, donate_argnums=(1,), in_shardings=rep, out_shardings=rep)
        self._exec: dict[int, object] = {}
        self.launches = 0          # encoder programs run (warm-up's excluded)
        self.frames_encoded = 0

    def warm_up(self, pool: jax.Array, progress: Progress | None = None) -> jax.Array:
        """Compile every bucket and run each once on padding frames (they write nothing); the pool back."""
        for i, n in enumerate(self.buckets):
            t0 = time.perf_counter()
            spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)
            self._exec[n] = self._jit.lower(
                [spec(a.shape, a.dtype) for a in self._leaves], spec(pool.shape, pool.dtype),
                spec((n, 3, self.side, self.side), jnp.float32), spec((n, self.patches, self.patches), jnp.bool_),
                spec((n,), jnp.int32)).compile()
            pool = self._run(pool, np.zeros((0, 3, self.side, self.side), np.float32),
                             np.zeros((0, self.patches, self.patches), bool), np.zeros(0, np.int32), n)
            if progress:
                progress(i + 1, len(self.buckets), f"frames={n}", time.perf_counter() - t0)
        return pool

    def encode(self, owner: Any, pixels: np.ndarray, mask: np.ndarray, slots: np.ndarray) -> None:
        """Launch the encoder on frames [F, 3, side, side] (mask [F, n, n]) into pool slots [F] of
        `owner.image_pool` (CompiledStep), which each launch replaces (the old buffer is donated)."""
        big = self.buckets[-1]
        for a in range(0, len(slots), big):
            n = len(slots[a:a + big])
            bucket = next(b for b in self.buckets if b >= n)
            owner.image_pool = self._run(owner.image_pool, pixels[a:a + big], mask[a:a + big], slots[a:a + big],
                                         bucket)
            self.launches += 1
            self.frames_encoded += n

    def _run(self, pool: jax.Array, pixels: np.ndarray, mask: np.ndarray, slots: np.ndarray,
             bucket: int) -> jax.Array:
        n = len(slots)
        if pixels.shape[1:] != (3, self.side, self.side):
            raise ValueError(f"image frames of {pixels.shape[2:]} pixels; the encoder takes {self.side}")
        pad = bucket - n   # padding frames: whole masks (no all-masked attention), slots past the pool
        pixels = np.concatenate([pixels, np.zeros((pad, 3, self.side, self.side), np.float32)])
        mask = np.concatenate([mask.astype(bool), np.ones((pad, self.patches, self.patches), bool)])
        dest = np.concatenate([slots.astype(np.int32), np.full(pad, self.num_slots, np.int32)])
        return self._exec[bucket](self._leaves, pool, pixels, mask, dest)
