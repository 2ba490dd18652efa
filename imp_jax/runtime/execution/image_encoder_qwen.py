"""Qwen2.5-VL's vision tower as its own compiled program: images' patches in, their rows written straight into
the row pool (the same pool and bookkeeping as Idefics3's, runtime/scheduling/image_rows.py).

An image of grid (1, h, w) patches gives h*w / merge^2 rows, a count that varies per image, so a program is
bucketed on two sizes: patches N (powers of two, a multiple of merge^2) and windows W (powers of four from
the fewest that more than N / 2 patches fill, (N / 2) / window_len, up to the most, N / merge^2). Several images go in
one launch, concatenated (model/vision/qwen2_5_vl.py VisionLayout keeps full attention within each frame);
each output row has its pool row in `dest`, padding rows one past the pool (`mode="drop"` writes them
nowhere). Every bucket compiles at start-up; a launch is an asynchronous dispatch on the engine thread.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from PIL import Image

from imp_jax.model.vision.qwen2_5_vl import VisionLayout
from imp_jax.model.vision.qwen2_5_vl_processor import preprocess
from imp_jax.model.vision.side import LoadedVision
from imp_jax.runtime.execution.batch import pow2_buckets
from imp_jax.runtime.parallel.sharding import replicated

Progress = Callable[[int, int, str, float], None]   # (i, n, bucket label, seconds)
MIN_PATCH_BUCKET = 64   # smaller images are padded to it: below it a program costs more than it saves


@dataclasses.dataclass(frozen=True)
class QwenPixels:
    """One image as the encoder takes it: flat patches [t*h*w, C*T*p*p] float32 and its grid (t, h, w)."""

    patches: np.ndarray
    grid: tuple[int, int, int]


def pixels_of(pixels: np.ndarray, vision: LoadedVision) -> QwenPixels:
    """Preprocess one RGB uint8 image (resize, normalise, patchify: Pillow, unbounded host work)."""
    out = preprocess([Image.fromarray(pixels, "RGB")], vision.processor)
    return QwenPixels(out.pixel_values, out.image_grid_thw[0])


def window_buckets(lo: int, hi: int) -> list[int]:
    """Window counts from lo up to hi in steps of 4 (hi last): a launch pads at most 4x the windows it has,
    for half the programs of steps of 2 (a full-size image of the real model has 8 patch buckets)."""
    out, w = [], lo
    while w < hi:
        out.append(w)
        w *= 4
    return out + [hi]


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class QwenImageEncoder:
    """The tower's programs and parameters; writes into the `pool` it is given (CompiledStep.image_pool)."""

    def __init__(self, vision: LoadedVision, pool_rows: int, max_patches: int, mesh):
        c = vision.config.vision
        self.merge2, self.window_len, self.patch_dim = c.spatial_merge_size ** 2, c.window_len, c.patch_dim
        self.vision_config = c
        self.pool_rows = pool_rows
        hi = _pow2_at_least(max(max_patches, self.merge2))
        patch_buckets = pow2_buckets(min(MIN_PATCH_BUCKET, hi), hi)
        self.buckets: list[tuple[int, int]] = []
        for N in patch_buckets:
            # more than N / 2 patches (a smaller bucket held fewer) fill at least that / window_len windows
            lo = 1 if N == patch_buckets[0] else _pow2_at_least(-(-(N // 2 + 1) // self.window_len))
            self.buckets += [(N, W) for W in window_buckets(min(lo, N // self.merge2), N // self.merge2)]
        self.max_patches = hi
        graphdef, state = nnx.split(vision.encoder)
        leaves, treedef = jax.tree.flatten(state)
        rep = replicated(mesh)
        self._leaves = jax.device_put(leaves, rep)

        def encode(leaves, pool, patches, positions, segments, windows, dest):
            encoder = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
            rows = encoder(patches, positions, segments, windows)   # [N / merge^2, hidden]
            return pool.at[dest].set(rows.astype(pool.dtype), mode="drop")

        self._jit = jax.jit(encode, donate_argnums=(1,), in_shardings=rep, out_shardings=rep)
        self._exec: dict[tuple[int, int], Any] = {}
        self.launches = 0          # encoder programs run (warm-up's excluded)
        self.frames_encoded = 0    # images encoded (the stats' name is Idefics3's)

    def warm_up(self, pool: jax.Array, progress: Progress | None = None) -> jax.Array:
        """Compile every (patches, windows) bucket and run each once on padding (it writes nothing)."""
        spec = jax.ShapeDtypeStruct
        for i, (N, W) in enumerate(self.buckets):
            t0 = time.perf_counter()
            self._exec[(N, W)] = self._jit.lower(
                [spec(a.shape, a.dtype) for a in self._leaves], spec(pool.shape, pool.dtype),
                spec((N, self.patch_dim), jnp.float32), spec((N, 2), jnp.int32), spec((N,), jnp.int32),
                spec((W, self.window_len), jnp.int32), spec((N // self.merge2,), jnp.int32)).compile()
            pool = self._run(pool, [], [], [], (N, W))
            if progress:
                progress(i + 1, len(self.buckets), f"patches={N}, windows={W}", time.perf_counter() - t0)
        return pool

    def bucket(self, num_patches: int, num_windows: int) -> tuple[int, int]:
        """The smallest compiled (N, W) holding this many patches and windows."""
        N = next(n for n, _ in self.buckets if n >= num_patches)
        return next(b for b in self.buckets if b[0] == N and b[1] >= num_windows)

    def encode(self, owner: Any, images: list[QwenPixels], dests: list[np.ndarray]) -> None:
        """Launch the tower on `images` (image i's rows to pool rows `dests[i]`) into `owner.image_pool`
        (CompiledStep), as few launches as the largest bucket allows; each replaces the pool (donated)."""
        group: list[int] = []
        for i, image in enumerate(images):
            if len(image.patches) > self.max_patches:
                raise ValueError(f"an image of {len(image.patches)} patches; the encoder takes {self.max_patches}")
            if group and sum(len(images[j].patches) for j in group) + len(image.patches) > self.max_patches:
                self._launch(owner, [images[j] for j in group], [dests[j] for j in group])
                group = []
            group.append(i)
        if group:
            self._launch(owner, [images[j] for j in group], [dests[j] for j in group])

    def _launch(self, owner: Any, images: list[QwenPixels], dests: list[np.ndarray]) -> None:
        grids = [im.grid for im in images]
        layout = VisionLayout.of(grids, self.vision_config)
        bucket = self.bucket(layout.num_real, len(layout.windows))
        owner.image_pool = self._run(owner.image_pool, [im.patches for im in images], grids, dests, bucket)
        self.launches += 1
        self.frames_encoded += len(images)

    def _run(self, pool: jax.Array, patches: list[np.ndarray], grids: list, dests: list[np.ndarray],
             bucket: tuple[int, int]) -> jax.Array:
        N, W = bucket
        layout = VisionLayout.of(grids, self.vision_config, N, W)
        flat = np.zeros((N, self.patch_dim), np.float32)
        if patches:
            flat[:layout.num_real] = np.concatenate(patches)
        dest = np.full(N // self.merge2, self.pool_rows, np.int32)   # padding rows: past the pool
        if dests:
            d = np.concatenate([np.asarray(x, np.int32) for x in dests])
            dest[:len(d)] = d
        return self._exec[bucket](self._leaves, pool, flat, layout.positions, layout.segments, layout.windows, dest)
