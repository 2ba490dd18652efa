"""The projection GEMM for x86-64 CPUs (gemm_exact.h), called as an XLA FFI custom call.

`matmul_wt_cpu(x, w)` is x @ w.T for w in [out, in] layout and float32 x. It reads
- float32 weights, on 2 to 64 rows (decode steps; see MIN_ROWS, MAX_ROWS);
- narrow weights, on any number of rows, since XLA would first widen them to float32 on every
  call: bfloat16 ones (a bf16 checkpoint's matrices kept narrow, model/weights.py) and GGML
  blocks (a GGUF file's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, K-quant Q2_K..Q6_K, IQ4_XS, IQ4_NL and MXFP4
  matrices, ggml_blocks.py).
`takes(x, w)` says whether it reads a given product; kernels_pallas/gemm.py dispatches. Built on
first use (build.py): the library `gemm`, and `gemm_q8` once int8 activations are asked for.

`matmul_wt_cpu(x, w, int8_activations=True)` (`--gemm cpu_q8`, auto's pick for GGML blocks) gives
them llama.cpp's kind of arithmetic instead (gemm_q8.h, gemm_q8_k.h, gemm_q8_iq.h): each row of x rounded to
int8 per 32-wide block with a float32 scale, integer dot products with the blocks, float32 scaling and
sums. Faster (the weights are not widened), but the outputs are no longer the float32 product's: they
differ by the rounding of x. Every kept format has an integer path (Q8_FORMATS): Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1, Q2_K..Q6_K, and the table formats IQ4_XS, IQ4_NL and MXFP4 (their indices looked up as int8s;
MXFP4's E8M0 scale as llama.cpp reads it), so every matrix of a K-quant, i-quant or gpt-oss file, its
MoE experts included. Plain (float32, bfloat16) weights are read as before: the exact kernel. On a CPU with
the AVX-512 path the loader interleaves Q8_0, Q5_0, Q4_0, Q4_1, Q4_K, Q6_K, IQ4_XS and IQ4_NL matrices 16 rows
at a time (ggml_x16.py), which gemm_q8_x16.h reads with one int32 sum per block and output (its header gives
the order of the sums).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from imp_jax.kernels_pallas import ggml_blocks, ggml_x16
from imp_jax.kernels_pallas.cpu import build

TARGET = "imp_gemm_f32"
TARGET_BF16W = "imp_gemm_f32_bf16w"   # float32 x, bfloat16 w
BLOCK_TARGETS = {name: f"imp_gemm_f32_{name.lower()}w" for name in ggml_blocks.FORMATS}   # every GGML format
Q8_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ4_NL",
              "MXFP4")   # gemm_q8.h's integer paths: every format ggml_blocks keeps
Q8_TARGETS = {name: f"imp_gemm_q8_{name.lower()}w" for name in (*Q8_FORMATS, *ggml_x16.FORMATS)}
_HANDLERS = {TARGET: "ImpGemmF32", TARGET_BF16W: "ImpGemmBf16W",
             **{t: f"ImpGemm{name}W" for name, t in BLOCK_TARGETS.items()}}
_Q8_HANDLERS = {t: f"ImpGemmQ8{name}W" for name, t in Q8_TARGETS.items()}   # the library gemm_q8
MIN_ROWS = 2         # one row is a memory-bound GEMV, where XLA's dot already streams at full bandwidth
MAX_ROWS = 64        # above this XLA's own GEMM (which packs the weights, amortised over many rows) is faster


def available(int8_activations: bool = False) -> bool:
    """Whether the kernel is built, loaded and registered for this CPU (built on the first call),
    with its int8-activation (q8) handlers too when `int8_activations`."""
    return (all(build.register("gemm", target, handler) for target, handler in _HANDLERS.items())
            and (not int8_activations
                 or all(build.register("gemm_q8", target, handler) for target, handler in _Q8_HANDLERS.items())))


def interleaves() -> bool:
    """Whether the q8 GEMM here reads matrices interleaved 16 rows at a time (ggml_x16.py,
    gemm_q8_x16.h): its library built and running its AVX-512 path (not forced lower by IMP_JAX_Q8_ISA)."""
    lib = build.load("gemm_q8") if available(int8_activations=True) else None
    return lib is not None and lib.imp_gemm_q8_isa() == 2


def _target(w: jax.Array, int8_activations: bool = False) -> str | None:
    """The kernel's custom call for this weight matrix (GGML blocks with int8 activations when
    asked), or None for a format it does not read."""
    if w.ndim == 2 and w.dtype in (jnp.float32, jnp.bfloat16):
        return TARGET if w.dtype == jnp.float32 else TARGET_BF16W
    fmt = ggml_blocks.format_of(w)
    if fmt is None:
        return None
    if fmt in ggml_x16.FORMATS:   # interleaved for the q8 tiles at load: read only by them
        return Q8_TARGETS[fmt]
    # int8 activations for the formats the q8 library has (all of ggml_blocks.FORMATS; a new one without
    # an integer path would be widened exactly)
    return Q8_TARGETS[fmt] if int8_activations and fmt in Q8_TARGETS else BLOCK_TARGETS[fmt]


def takes(x: jax.Array, w: jax.Array) -> bool:
    """Whether the kernel reads x @ w.T: float32 x, a weight format it knows, and for float32
    weights a row count where it beats XLA's dot."""
    target, rows = _target(w), math.prod(x.shape[:-1])
    if x.dtype != jnp.float32 or target is None:
        return False
    return target != TARGET or MIN_ROWS <= rows <= MAX_ROWS


def matmul_wt_cpu(x: jax.Array, w: jax.Array, int8_activations: bool = False) -> jax.Array:
    """x [..., K] @ w.T for w [N, K] (float32, bfloat16 or GGML blocks), float32 out; for GGML
    blocks with x rounded to int8 when `int8_activations` (the module docstring says how)."""
    out = jax.ShapeDtypeStruct(x.shape[:-1] + ggml_blocks.matrix_shape(w)[:1], jnp.float32)
    target = _target(w, int8_activations)
    if target in _Q8_HANDLERS and not available(int8_activations=True):
        raise RuntimeError("the q8 GEMM kernel did not build (see the log)")
    return jax.ffi.ffi_call(target, out)(x, w)
