"""The contract a causal LM honours to be served, and the options the engine builds it with.

A model class (built in: llama.py; yours: `--model-class package.module:Class`) provides:

    Model(config: ModelConfig, options: ModelOptions, *, rngs: nnx.Rngs)      random init
    Model.from_hf_tensors(config, weights: WeightSource, options) -> Model    from a checkpoint
    model(input_ids[T], positions[T], kv, meta) -> (hidden[T, E], kv)        the ragged forward
    model.logits(hidden[R, E]) -> float32 [R, vocab]                         only the sampled rows
    model.kv_cache_shape(num_blocks, block_size) -> shape of K (and of V)
    model(..., residuals=True) -> (hidden, kv, [L, T, E])                  optional: logit_lens
    model(..., embed_rows=[M, E], embed_slots=[M]) -> (hidden, kv)          optional: images

`kv` is (K, V), each [num_layers, num_blocks, block_size, num_kv_heads, head_dim]; `meta` is
kernels_pallas.AttentionMetadata. A model calls `layers.linear` and
`kernels_pallas.ragged_paged_attention` with `options.kernels`, declares its linear weights as
`weights.Matrix` (so the loader may store them narrow) and names every parameter's axes
(`axes=(...)` metadata, names from `AXES`) so the engine can shard it. docs/ARCHITECTURE.md has
a worked example.

Embedding overrides: a class that sets `takes_embed_rows = True` accepts `embed_rows` [M, E] and
`embed_slots` [M] int32, rows that replace the embeddings of token rows `embed_slots` before the
first layer (an image's rows over its `<image>` tokens); a slot >= T is padding and writes nowhere.
The engine passes them only to such a class, and only in a step that has them.

Multimodal positions: a config with `mrope_section` (Qwen2.5-VL) takes `positions` [3, T] (temporal, height,
width per token; model/vision/mrope.py computes them) as well as [T] (all three equal: text only).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from imp_jax.kernels_pallas import XLA, AttentionMetadata, Kernels
from imp_jax.model.config import ModelConfig

LAYER_LOOPS = ("scan", "unroll")
# Logical axis names for parameters and the KV cache; runtime/parallel/sharding.py maps them onto a mesh.
AXES = ("layers", "vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "qkv", "gate_up")
KVCache = tuple[jax.Array, jax.Array]   # K and V, each [L, num_blocks, block_size, KVH, D]
KV_CACHE_AXES = ("layers", None, None, "kv_heads", None)


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """How the engine wants a model built (hashable: a static part of the model)."""

    dtype: Any = jnp.float32          # compute and weight dtype (matrices may be stored narrower)
    layer_loop: str = "scan"          # "scan" over layers (fast compiles) or "unroll"
    kernels: Kernels = XLA            # attention and GEMM implementations (kernels_pallas.select_kernels)
    tensor_parallel: int = 1          # shards the model's weights are laid out for (model/tensor_parallel.py);
                                      # above 1 its forward runs under shard_map over the "tp" mesh axis

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {self.tensor_parallel}")
        if self.layer_loop not in LAYER_LOOPS:
            raise ValueError(f"layer_loop must be one of {LAYER_LOOPS}, got {self.layer_loop!r}")


def default_layer_loop(platform: str) -> str:
    """`scan` on CPUs: it compiles several times faster than an unrolled loop and its per-layer
    weight pick (`lax.switch`) reads weights in place. `unroll` elsewhere: on XLA:GPU a switch on a
    traced index can cost a device-to-host sync per layer (docs/PERF.md)."""
    return "scan" if platform == "cpu" else "unroll"


def takes_embed_rows(model: Any) -> bool:
    """Whether a model (or model class) declares the optional `embed_rows`/`embed_slots` arguments."""
    return getattr(model, "takes_embed_rows", False) is True


class CausalLM(Protocol):
    """What the engine calls on a model (see the module docstring)."""

    config: ModelConfig
    options: ModelOptions

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv: KVCache,
                 meta: AttentionMetadata) -> tuple[jax.Array, KVCache]: ...

    def logits(self, hidden: jax.Array) -> jax.Array: ...

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]: ...
