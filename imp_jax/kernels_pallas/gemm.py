"""The one GEMM entry point: x @ w.T for weights in [out, in] layout, with the implementation the
engine chose (`Kernels.gemm`), where it reads this product; XLA's dot otherwise."""
from __future__ import annotations

import jax

from imp_jax.kernels_pallas.backends import XLA, Kernels
from imp_jax.kernels_pallas.cpu import gemm as cpu_gemm
from imp_jax.kernels_pallas.xla.gemm import matmul_wt_xla


def matmul_wt(x: jax.Array, w: jax.Array, kernels: Kernels = XLA) -> jax.Array:
    """x [..., K] @ w.T for w [N, K] (plain, or GGML blocks: ggml_blocks.py), accumulated and
    returned in float32 (with `cpu_q8`, GGML blocks meet x rounded to int8: cpu/gemm.py)."""
    if kernels.cpu_gemm and cpu_gemm.takes(x, w):
        return cpu_gemm.matmul_wt_cpu(x, w, int8_activations=kernels.gemm == "cpu_q8")
    return matmul_wt_xla(x, w)
