"""Pictures for the image tests: a PIL image of gradients and noise (the resamplers have something to do) and
a PNG of colour bands and noise, each the same for the same seed."""
from __future__ import annotations

import io

import numpy as np
from PIL import Image


def synthetic_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """Smooth gradients plus noise (LANCZOS has something to do), RGB uint8."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width, 1), y * 255 / max(height, 1), (x + y) % 256], -1)
    noisy = base + rng.normal(0, 30, base.shape)
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8), "RGB")


def picture(width: int, height: int, seed: int) -> bytes:
    """A PNG of smooth colour bands plus noise (the same seed, the same picture)."""
    rng = np.random.default_rng(seed)
    x = np.linspace(0, 1, width)[None, :, None] * rng.uniform(50, 255, 3) + rng.uniform(0, 60, 3)
    y = np.linspace(0, 1, height)[:, None, None] * rng.uniform(0, 120, 3)
    noise = rng.normal(0, 20, (height, width, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(x + y + noise, 0, 255).astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()
