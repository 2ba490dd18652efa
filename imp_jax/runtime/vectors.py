"""Host-side finishing of embedding vectors (numpy only, so the server may use it without jax)."""
from __future__ import annotations

import numpy as np


def finish_embeddings(vectors: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """Keep the first `dimensions` of each row (Matryoshka truncation), then scale rows to unit length
    when the model normalises (so a truncated vector is a unit vector again)."""
    out = np.asarray(vectors[:, :dimensions] if dimensions else vectors, np.float32)
    if normalize:
        out = out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
    return out
