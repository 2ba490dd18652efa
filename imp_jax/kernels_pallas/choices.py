"""The operator's kernel choices (`--attention`, `--gemm`, `--quantized-weights`), without importing jax:
the server's flags refuse any other name before anything starts (runtime/config.py)."""
from __future__ import annotations

ATTENTION_BACKENDS = ("auto", "xla", "cpu", "pallas")
GEMM_BACKENDS = ("auto", "xla", "exact", "cpu_q8")   # EngineConfig also reads "cpu", the old name of "exact"
CPU_GEMMS = ("exact", "cpu_q8")   # the x86-64 C++ kernel, exact or with int8 activations
QUANTIZED_CHOICES = ("auto", "keep", "dequantize")
