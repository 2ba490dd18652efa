"""Kernels: ragged paged attention and the projection GEMM, each behind one dispatch point.

    attention.py, gemm.py   the entry points models call, dispatching on `Kernels`
    backends.py             `Kernels` and `select_kernels`: the choice, made once per engine
    self_test.py            `select_tested_kernels`: that choice, each non-XLA backend first checked against XLA
    metadata.py, kv_cache.py  the contracts: batch metadata, the paged cache's layout and writes
    ggml_blocks.py          GGUF block-quantised matrices (Q8_0, Q4_x, Q5_x, Q2_K-Q6_K)
    xla/                    plain XLA: the portable backend, and the attention oracle for tests
    pallas/                 the Mosaic GPU (Hopper) attention kernel
    cpu/                    the x86-64 C++ kernels (XLA FFI) and their build
"""
from __future__ import annotations

import importlib
from typing import Any

# Loaded on first use, so that `imp_jax.kernels_pallas.cpu.build` can start the C++ builds before the
# server imports jax (the first start's compile runs beside that import: docs/PERF.md, Cold start).
_EXPORTS = {"ggml_blocks": "ggml_blocks", "paged_attention": "attention", "ragged_paged_attention": "attention",
            "XLA": "backends", "Kernels": "backends", "select_kernels": "backends",
            "select_tested_kernels": "self_test", "matmul_wt": "gemm",
            "kv_storage_dtype": "kv_cache", "AttentionMetadata": "metadata", "AttentionShape": "metadata"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
    value = module if name == _EXPORTS[name] else getattr(module, name)
    globals()[name] = value
    return value
