"""A GGUF file's key/value metadata as the loader and the families' GGUF readers (model/family.py) read it:
required keys as ModelLoadErrors, float32 values as the decimals they were written from, llama.cpp's
sliding-window pattern."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from imp_jax.errors import ModelLoadError
from imp_jax.model.formats.gguf_file import GGUFFile


class Metadata:
    """The file's key/value metadata as Python values."""

    def __init__(self, reader: GGUFFile, path: Path):
        self.path = path
        self.values: dict[str, Any] = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def need(self, key: str) -> Any:
        if key not in self.values:
            raise ModelLoadError(f"{self.path}: GGUF metadata lacks '{key}'")
        return self.values[key]


def f32(x: float) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(x)))


def opt_f32(x: float | None) -> float | None:
    return None if x is None else f32(x)


def layer_types(meta: Metadata, arch: str, layers: int, period: int) -> list[str]:
    """Which layers slide, as llama.cpp's `load_swa_pattern` reads `attention.sliding_window_pattern`:
    a per-layer bool array (true = sliding), or a period n (default `period`) where layer i slides
    unless i % n == n - 1 (n = 0: every layer slides)."""
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = meta.get(key, period)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ModelLoadError(f"{meta.path}: {key} has {len(pattern)} entries for {layers} layers")
        return ["sliding_attention" if p else "full_attention" for p in pattern]
    n = int(pattern)
    return ["sliding_attention" if n == 0 or i % n < n - 1 else "full_attention" for i in range(layers)]
