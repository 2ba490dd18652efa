"""Qwen2-VL / Qwen2.5-VL multimodal RoPE positions (transformers' `get_rope_index`, for images), in NumPy.

Every token has three position components (temporal, height, width). Text tokens have all three equal and
count up by one. An image of grid (t, h, w) patches covers t * h/m * w/m tokens (m: the merge size); its
token (f, r, c) sits at start + (f, r, c), start being the position the next text token would have had;
the text after it resumes at start + max(h, w) / m (for images t = 1, so that is max + 1). The prompt thus
uses fewer positions than tokens: decode token i (0-based sequence index) has position i + delta in all
three components, delta = max position + 1 - prompt length (<= 0).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def get_rope_index(input_ids: Sequence[int], grids: Sequence[Sequence[int]], image_token_id: int,
                   merge_size: int) -> tuple[np.ndarray, int]:
    """Positions [3, T] int64 of a prompt whose k-th run of `image_token_id` is image k (grid (t, h, w)), and
    the sequence's decode delta. A run must hold exactly that image's t*h*w / m^2 tokens."""
    ids = np.asarray(input_ids)
    out = np.zeros((3, len(ids)), np.int64)
    images = iter(grids)
    i, pos = 0, 0
    while i < len(ids):
        if ids[i] != image_token_id:
            out[:, i] = pos
            i, pos = i + 1, pos + 1
            continue
        try:
            t, h, w = next(images)
        except StopIteration:
            raise ValueError(f"image token at {i} but only {len(grids)} image grids") from None
        h, w = h // merge_size, w // merge_size
        n = t * h * w
        run = ids[i:i + n + 1] == image_token_id   # the image's tokens and the one after
        if run[:n].sum() != n or (len(run) > n and run[n]):
            raise ValueError(f"the image at token {i} needs exactly {n} consecutive image tokens")
        f, r, c = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        out[:, i:i + n] = pos + np.stack([f.reshape(-1), r.reshape(-1), c.reshape(-1)])
        i, pos = i + n, pos + max(h, w)
    if next(images, None) is not None:
        raise ValueError(f"{len(grids)} image grids for fewer images in the prompt")
    delta = int(out.max()) + 1 - len(ids) if len(ids) else 0
    return out, delta
