"""How a model's weight matrices are stored: the loader decides it here, once, from the kernels.

A `Matrix` is a parameter the model reads only through `layers.linear` (projections, LM head) or
`layers.embed` (the embedding table), so it may be stored in any format those read:
- GGML blocks (kernels_pallas/ggml_blocks.py): a GGUF's Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1, K-quant
  (Q2_K..Q6_K), IQ4 and MXFP4 matrices as stored, and (`WeightSource.stack`, model/architectures/moe.py) its
  mixture-of-experts stacks [E, out, in / W, bytes], as gpt-oss's HF MXFP4 experts are too;
- bfloat16: a float32 matrix whose every value is a bfloat16 (a bf16 checkpoint run in float32);
- for the q8 GEMM on an AVX-512 CPU, Q8_0, Q5_0, Q4_0, Q4_1, Q4_K, Q6_K, IQ4_XS and IQ4_NL blocks interleaved 16
  rows at a time (ggml_x16.py: the file's bytes in another order).
All hold the float32 matrices' values exactly (the first two at a quarter to half the bytes).
They pay only where the GEMM reads them as they are (the x86-64 CPU kernel); XLA's dot would
widen them on every call, so elsewhere matrices stay in the model's dtype.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from imp_jax.errors import ModelLoadError
from imp_jax.kernels_pallas import Kernels, ggml_blocks, ggml_x16
from imp_jax.kernels_pallas.cpu import gemm as cpu_gemm


class Matrix(nnx.Param):
    """A weight matrix read only through `layers.linear` / `layers.embed`: stored as `WeightFormats` say."""


@dataclasses.dataclass(frozen=True)
class WeightFormats:
    """The narrow storage the loader may give `Matrix` parameters."""

    ggml_blocks: bool = False   # keep a GGUF's quantised blocks (ggml_blocks.FORMATS) as stored
    exact_bf16: bool = False    # store an all-bfloat16-valued float32 matrix as bfloat16

    @classmethod
    def for_model(cls, kernels: Kernels, dtype: Any) -> "WeightFormats":
        """GGML blocks where `kernels.keeps_blocks` (for the CPU GEMM kernel: in a float32 model, the
        activations it takes), bf16 storage of float32 matrices for a float32 model whose GEMM reads it."""
        f32 = jnp.dtype(dtype) == jnp.float32
        narrow = kernels.reads_narrow_weights and f32
        return cls(ggml_blocks=kernels.keeps_blocks and (f32 or not kernels.reads_narrow_weights), exact_bf16=narrow)


class WeightSource:
    """A checkpoint's HF-named tensors as `from_hf_tensors` reads them: `tensor(name)` as float32,
    `matrix(*names)` as the loader chose to store that matrix."""

    def __init__(self, tensors: Mapping[str, np.ndarray], formats: WeightFormats = WeightFormats(),
                 source: str = "checkpoint"):
        self._tensors = tensors
        self.formats = formats
        self.source = source

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> np.ndarray:
        """The tensor `name` as float32; a ModelLoadError naming it when the checkpoint lacks it."""
        try:
            return np.asarray(self._tensors[name], np.float32)
        except KeyError:
            raise ModelLoadError(f"{self.source}: weight '{name}' not found") from None

    def matrix(self, *names: str) -> np.ndarray:
        """The [out, in] matrix of `names` concatenated along the output axis: GGML blocks when
        they are kept and every part has them in one format, float32 otherwise."""
        if self.formats.ggml_blocks:
            kept = _join_blocks([self._blocks(n) for n in names])
            if kept is not None:
                return kept
        parts = [self.tensor(n) for n in names]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def stack(self, *names: str) -> np.ndarray:
        """The expert stack [E, out, in] of `names` (each a whole stack, [E, out_i, in]) joined along
        the output axis: GGML blocks [E, out, in / W, bytes] when they are kept and every part has them
        in one format (or Q4_0 / Q5_0 / Q8_0, then as Q8_0), float32 otherwise."""
        if self.formats.ggml_blocks:
            kept = _join_blocks([self._blocks(n) for n in names], axis=1)
            if kept is not None:
                return kept
        parts = [self.tensor(n) for n in names]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)

    def _blocks(self, name: str) -> np.ndarray | None:
        blocks = getattr(self._tensors, "blocks", None)   # only a GGUF file has them
        return blocks(name) if blocks is not None and name in self._tensors else None


def stored(value: np.ndarray, dtype: Any, on_host: bool = False) -> jax.Array | np.ndarray:
    """A value from a WeightSource as a parameter holds it: GGML blocks as their bytes, floats as
    `dtype`; on the default device, or `on_host` for the engine to place shard by shard."""
    as_array = np.asarray if on_host else jnp.asarray
    return as_array(value) if ggml_blocks.format_of(value) else as_array(value, dtype)


def _join_blocks(parts: list[np.ndarray | None], axis: int = 0) -> np.ndarray | None:
    """One matrix of `parts` (GGML blocks, or None for a tensor without readable ones) joined along
    `axis` when they share one format, or are all Q4_0 / Q5_0 / Q8_0 (then as Q8_0, which holds each
    exactly); else None."""
    if any(p is None for p in parts):
        return None
    formats = {ggml_blocks.format_of(p) for p in parts}
    if len(formats) > 1:
        if not formats <= ggml_blocks.WIDENS_TO_Q8_0:
            return None
        parts = [ggml_blocks.to_q8_0(p) for p in parts]   # exact: the same float32 weights
    return np.concatenate(parts, axis=axis) if len(parts) > 1 else parts[0]


def _matrices(model: nnx.Module) -> Iterator[tuple[Matrix, Any]]:
    """Each `Matrix` parameter of `model` with its value."""
    for _, param in nnx.iter_graph(model):
        if isinstance(param, Matrix):
            yield param, param.get_value()


def narrow_exact_bf16(model: nnx.Module, formats: WeightFormats) -> int:
    """Store every float32 `Matrix` of `model` whose values are all bfloat16 as bfloat16, when
    `formats` allow; returns the bytes saved."""
    if not formats.exact_bf16:
        return 0
    saved = 0
    for param, w in _matrices(model):
        if w.dtype != jnp.float32 or w.ndim != 2 or np.any(np.asarray(w).view(np.uint32) & 0xFFFF):
            continue
        param.set_value(np.asarray(w, jnp.bfloat16) if isinstance(w, np.ndarray) else jnp.asarray(w, jnp.bfloat16))
        saved += w.nbytes // 2
    return saved


def interleave_for_q8(model: nnx.Module, kernels: Kernels, tensor_parallel: int = 1) -> int:
    """Store every Q8_0, Q5_0, Q4_0, Q4_1, Q4_K, Q6_K, IQ4_XS and IQ4_NL `Matrix` of `model` (N a multiple of 16)
    interleaved 16 rows at a time (ggml_x16.py) when its products are the q8 GEMM's (`--gemm cpu_q8`) on a CPU with the AVX-512 path,
    which reads them with one int32 sum per block and output (cpu/gemm_q8_x16.h); not under tensor
    parallelism (whose shards slice the file's layout). Returns how many were interleaved. The bytes are
    the file's in another order (Q4_K's scales as bytes: 4 more a super-block); `layers.embed` reads a
    table's rows back out."""
    if kernels.gemm != "cpu_q8" or tensor_parallel != 1 or not cpu_gemm.interleaves():
        return 0
    count = 0
    for param, w in _matrices(model):
        fmt = ggml_blocks.format_of(w)
        if fmt not in ggml_x16.OF or w.ndim != 3 or w.shape[0] % ggml_x16.ROWS:
            continue
        groups = ggml_x16.interleave(np.asarray(w), fmt)
        param.set_value(groups if isinstance(w, np.ndarray) else jnp.asarray(groups))
        count += 1
    return count


def describe(model: nnx.Module) -> str:
    """One line for the log: the weights' MiB, how many arrays of each storage format, and of those
    how many are mixture-of-experts stacks kept as GGML blocks, by format."""
    arrays = jax.tree.leaves(nnx.state(model))
    formats = Counter(ggml_blocks.format_of(a) or jnp.dtype(a.dtype).name for a in arrays)
    stacks = Counter(ggml_blocks.format_of(a) for a in arrays if ggml_blocks.format_of(a) and a.ndim == 4)
    mib = sum(a.nbytes for a in arrays) / 2**20
    line = f"{mib:.0f} MiB in " + ", ".join(f"{n} {f}" for f, n in formats.most_common())
    if stacks:
        line += "; expert stacks kept as blocks: " + ", ".join(f"{n} {f}" for f, n in stacks.most_common())
    return line
