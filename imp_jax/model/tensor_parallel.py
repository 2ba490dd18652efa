"""How a decoder splits over N tensor-parallel shards, and the shard-major order its fused weights
are stored in so that each shard's slice of a sharded axis is exactly its own rows.

Attention: when N divides the KV heads, shard d holds KV heads [d*KVH/N, (d+1)*KVH/N) and their
query heads. Otherwise every shard holds every KV head (the cache is replicated, computed on every
shard) and each query group of g heads is split into N runs of ceil(g/N), zero-padded, so shard d
holds run d of every group: its local query head j still reads local KV head j // (heads per group).
MLP: ceil(I/N) intermediate rows per shard, zero-padded; a mixture of experts' stacked experts, shared
expert and dense layers split the same way, each by its own width (`rows`, `fused_index`). Vocabulary: split when N divides it,
else the embedding and LM head are replicated. Padding is zero weights: padded heads and rows add
exactly nothing after the row-parallel projections (o_proj, down_proj) and their psum.
With N = 1 every order is the checkpoint's own and nothing is padded.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from imp_jax.kernels_pallas import ggml_blocks
from imp_jax.model.config import ModelConfig

AXIS = "tp"   # the mesh axis a sharded model's collectives run over


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """The per-shard sizes of a decoder on `n` shards (hashable: part of the model's static options)."""

    n: int
    kv_sharded: bool     # N divides the KV heads; else each shard holds all of them
    local_heads: int     # query heads per shard (padding included)
    local_kv_heads: int
    local_mlp: int       # intermediate rows per shard (padding included)
    vocab_parallel: bool

    @classmethod
    def of(cls, cfg: ModelConfig, n: int) -> "TensorParallel":
        if n < 1:
            raise ValueError(f"tensor-parallel size must be >= 1, got {n}")
        group = cfg.num_heads // cfg.num_kv_heads
        kv_sharded = cfg.num_kv_heads % n == 0
        if kv_sharded:
            kv = cfg.num_kv_heads // n
            heads = kv * group
        else:
            kv, heads = cfg.num_kv_heads, cfg.num_kv_heads * -(-group // n)
        vocab_parallel = n > 1 and cfg.vocab_size % n == 0
        return cls(n, kv_sharded, heads, kv, -(-cfg.intermediate_size // n), vocab_parallel)

    def describe(self, cfg: ModelConfig) -> str:
        kv = (f"{self.local_kv_heads} KV heads per shard" if self.kv_sharded else
              f"KV heads replicated ({cfg.num_kv_heads} on every shard: {self.n} does not divide them)")
        pad = self.n * self.local_heads - cfg.num_heads
        count = getattr(cfg, "num_experts", 0)   # a mixture of experts' (model/architectures/moe.py: MoEConfig)
        experts = (f", {self.padded(cfg.moe_intermediate_size or cfg.intermediate_size) // self.n} rows "
                   f"of each of {count} experts per shard" if count else "")
        return (f"tensor parallel over {self.n}: {self.local_heads} query heads per shard"
                f"{f' ({pad} zero-padded in all)' if pad else ''}, {kv}, {self.local_mlp} MLP rows per shard"
                f"{experts}, vocabulary {'split' if self.vocab_parallel else 'replicated'}")

    # -- which global rows each shard holds (-1: a zero pad)
    def q_heads(self, cfg: ModelConfig, d: int) -> list[int]:
        group = cfg.num_heads // cfg.num_kv_heads
        if self.kv_sharded:
            return [kv * group + i for kv in self.kv_heads(cfg, d) for i in range(group)]
        run = self.local_heads // cfg.num_kv_heads
        return [kv * group + d * run + i if d * run + i < group else -1
                for kv in range(cfg.num_kv_heads) for i in range(run)]

    def kv_heads(self, cfg: ModelConfig, d: int) -> list[int]:
        return list(range(d * self.local_kv_heads, (d + 1) * self.local_kv_heads)) if self.kv_sharded \
            else list(range(cfg.num_kv_heads))

    def mlp_rows(self, cfg: ModelConfig, d: int) -> list[int]:
        return self.rows(cfg.intermediate_size, d)

    def padded(self, size: int) -> int:
        """An axis of `size` rows split over the shards: ceil(size / N) per shard, N times."""
        return self.n * -(-size // self.n)

    def rows(self, size: int, d: int) -> list[int]:
        """The rows of an axis of `size` that shard d holds (-1: a zero pad)."""
        local = self.padded(size) // self.n
        return [r if r < size else -1 for r in range(d * local, (d + 1) * local)]

    def split_index(self, size: int) -> np.ndarray:
        """The shard-major indices of an axis of `size` rows (a row-parallel input axis)."""
        return np.asarray([r for d in range(self.n) for r in self.rows(size, d)])

    def fused_index(self, size: int) -> np.ndarray:
        """The shard-major indices into a fused [gate | up] axis of 2 x `size` rows: per shard, its
        gate rows, then its up rows."""
        return np.asarray([i for d in range(self.n) for rows in (self.rows(size, d),)
                           for i in rows + [r + size if r >= 0 else -1 for r in rows]])

    # -- the shard-major indices of the fused axes, into the checkpoint's [q | k | v] and [gate | up]
    def qkv_index(self, cfg: ModelConfig) -> np.ndarray:
        D, q = cfg.head_dim, cfg.q_size
        heads = lambda hs, base: [base + h * D + j if h >= 0 else -1 for h in hs for j in range(D)]
        return np.asarray([i for d in range(self.n) for i in
                           heads(self.q_heads(cfg, d), 0) + heads(self.kv_heads(cfg, d), q)
                           + heads(self.kv_heads(cfg, d), q + cfg.kv_size)])

    def head_index(self, cfg: ModelConfig) -> np.ndarray:
        """The shard-major query heads (-1: a zero pad), for per-head vectors (gpt-oss's sinks)."""
        return np.asarray([h for d in range(self.n) for h in self.q_heads(cfg, d)])

    def o_index(self, cfg: ModelConfig) -> np.ndarray:
        D = cfg.head_dim
        return np.asarray([h * D + j if h >= 0 else -1 for d in range(self.n)
                           for h in self.q_heads(cfg, d) for j in range(D)])

    def gate_up_index(self, cfg: ModelConfig) -> np.ndarray:
        return self.fused_index(cfg.intermediate_size)

    def down_index(self, cfg: ModelConfig) -> np.ndarray:
        return self.split_index(cfg.intermediate_size)


def take_rows(value: np.ndarray, index: np.ndarray) -> np.ndarray:
    """value[index] along axis 0 (output rows: plain or GGML-block matrices, vectors), zeros where -1."""
    out = np.asarray(value)[np.maximum(index, 0)]
    out[index < 0] = 0   # an all-zero GGML block is d = 0 (and m = 0): zero weights in every format
    return out


def take_columns(value: np.ndarray, index: np.ndarray, shards: int = 1) -> np.ndarray:
    """value[:, index] (input columns) of a [out, in] matrix, zeros where -1. A GGML-block matrix
    keeps its blocks when `index` moves whole aligned blocks (of 32 weights, 256 for K-quants) and
    each of its `shards` equal parts is whole blocks; else it is dequantised first."""
    if ggml_blocks.format_of(value) is not None:
        size = ggml_blocks.weights_per_block(value)   # 32, or 256 for a K-quant
        runs = index.reshape(-1, size) if index.size % (size * shards) == 0 else None
        first = runs[:, :1] if runs is not None else None
        whole = runs is not None and bool(np.all(
            ((runs == -1).all(axis=1)) | ((first[:, 0] % size == 0)
                                          & (runs == first + np.arange(size)).all(axis=1))))
        if whole:
            blocks = np.where(first[:, 0] < 0, -1, first[:, 0] // size)
            return np.swapaxes(take_rows(np.swapaxes(value, 0, 1), blocks), 0, 1).copy()
        value = np.asarray(ggml_blocks.dequantize(value))
    return np.swapaxes(take_rows(np.swapaxes(value, 0, 1), index), 0, 1).copy()


def take(value: np.ndarray, index: np.ndarray, axis: int, shards: int = 1) -> np.ndarray:
    """value's entries `index` along `axis`, zeros where -1: a GGML-block matrix's rows (axis 0) or
    columns (axis 1 or -1, `take_columns`: floats unless `index` moves whole blocks, whole blocks per
    one of `shards`), a stack of them
    (axis 1 / 2 of [E, N, K / W, bytes]), any axis of a float array (a stack of experts, a bias)."""
    if ggml_blocks.format_of(value) is not None:
        if value.ndim == 4:   # a stack of experts' matrices [E, N, K / W, bytes], split per expert
            if axis not in (1, 2):
                raise ValueError(f"a stack of GGML-block matrices splits along axis 1 or 2, not {axis}")
            return np.stack([take(v, index, axis - 1, shards) for v in value])
        return take_rows(value, index) if axis == 0 else take_columns(value, index, shards)
    return np.ascontiguousarray(np.moveaxis(take_rows(np.moveaxis(np.asarray(value), axis, 0), index), 0, axis))
