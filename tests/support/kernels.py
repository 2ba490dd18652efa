"""Checks on the attention kernel's lowered program (tests/test_pallas_export.py and its siblings)."""
from __future__ import annotations


def assert_hopper_kernel(text: str, dtype: str) -> None:
    """A Mosaic GPU custom call whose kernel loads K/V by TMA and multiplies by wgmma in `dtype`."""
    short = {"bfloat16": "bf16", "float16": "f16"}[dtype]
    assert "mosaic_gpu_v2" in text and "cp.async.bulk.tensor.shared.cluster.global" in text
    assert "wgmma.mma_async.sync.aligned.m64n" in text and f"k16.f32.{short}.{short}" in text
