"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE (with its sigmoid-gated shared expert) and Qwen3-MoE;
gpt-oss (model/architectures/gpt_oss.py) adds router and expert biases and its clamped SwiGLU (`ExpertAct`).

Attention, norms, embedding and LM head are model/architectures/llama.py's DecoderLM; only the feed-forward block
differs. A sparse layer routes each token to `num_experts_per_tok` of `num_experts` experts
(`route`), and the experts are one stacked weight per projection: gate|up [E, 2I, H] and down
[E, H, I], HF's [out, in] layout per expert, their leading axis named "experts".

The experts (`expert_ffn`) never drop a token. They run as a grouped matmul over tiles: the
step's real (token, expert) pairs sorted by expert, each expert's run padded to whole tiles of
TILE rows, one GEMM pair per used tile (the CPU GEMM kernel on an x86-64 CPU). It measured fastest
on this CPU at 1 to 32 sequences and in prefill (scripts/bench_moe.py, docs/PERF.md) against each
pair's expert read in place ("pairs"), one GEMM per expert over every token ("dense"),
`jax.lax.ragged_dot` over the sorted pairs ("ragged": XLA:CPU runs it about as densely as "dense",
and slower) and a per-token gather of the chosen experts' weights ("gather"), all kept for that
measurement.

Layers that Qwen2-MoE's `decoder_sparse_step` / `mlp_only_layers` leave dense keep a plain MLP of
`intermediate_size`. Under the `scan` layer loop each layer's feed-forward block is one branch of
a `lax.switch` on the layer index (as llama's projections are), so weights are read in place.

Tensor parallelism is Megatron's, per expert: every shard holds every expert's slice of the
intermediate axis (gate|up rows shard-major, `gate_up`; down's columns, `mlp`: ceil(I/N) each,
zero-padded, as a dense MLP's), routes every token itself (the router is replicated and its input is
too, so each shard picks the same experts), runs the grouped matmul on its slice and sums the
shards' partial outputs in the one psum after down. The shared expert and dense layers split as
dense MLPs; the shared expert's sigmoid gate is replicated; gpt-oss's gate|up bias splits with its
rows and its down bias is added on shard 0 only (`Projections.once`, model/projections.py, which also
owns the psum: `reduce`). Expert parallelism proper (experts split across devices, tokens moved by
all-to-all) is not done: the "experts" axis maps to no mesh axis.

Not supported (a clear ModelLoadError): LoRA adapters. Router ties go to
the lowest expert index (jax.lax.top_k); torch.topk on CPU picks among tied values in no
documented order, so transformers may route an exactly tied token elsewhere.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from imp_jax.errors import ModelLoadError
from imp_jax.kernels_pallas import XLA, Kernels, ggml_blocks, matmul_wt
from imp_jax.model.base import ModelOptions
from imp_jax.model.config import ModelConfig, attention_bias
from imp_jax.model.family import Family, GGUFNames
from imp_jax.model.formats.gguf_metadata import Metadata
from imp_jax.model.layers import linear
from imp_jax.model.architectures.llama import DecoderLayers, DecoderLM
from imp_jax.model.projections import Projections
from imp_jax.model.tensor_parallel import TensorParallel, take
from imp_jax.model.weights import Matrix, WeightSource, stored

log = logging.getLogger("imp_jax.loader")
EXPERT_IMPLS = ("tiles", "pairs", "dense", "ragged", "gather")
TILE = 8   # rows per tile of the `tiles` grouped matmul
DEFAULT_IMPL = "tiles"   # measured on this CPU: docs/PERF.md "Mixture of experts"
ROUTERS = ("softmax_topk", "topk_softmax")


@dataclasses.dataclass(frozen=True)
class MoEConfig(ModelConfig):
    """ModelConfig plus the experts (`FAMILY.parse` reads them); the defaults (no experts) are a dense model."""

    num_experts: int = 0                      # routed experts per sparse layer; 0: a dense model
    num_experts_per_tok: int = 0              # top-k
    moe_intermediate_size: int = 0            # each routed expert's; 0: intermediate_size (Mixtral)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert; 0: none
    norm_topk_prob: bool = False              # renormalise the k kept probabilities to sum to 1
    router: str = "softmax_topk"              # "softmax_topk" or "topk_softmax" (softmax of the k logits)
    expert_bias: bool = False                 # router and experts carry biases (gpt-oss)
    expert_act: str = "silu"                  # "silu": silu(gate) * up; "swiglu_clamped": gpt-oss's
    swiglu_alpha: float = 1.702               # swiglu_clamped: gate * sigmoid(alpha * gate) * (up + 1),
    swiglu_limit: float = 7.0                 # gate clamped above at limit, up to [-limit, limit]
    decoder_sparse_step: int = 1              # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()     # ... and i is not listed here (dense MLP of intermediate_size)

    def is_sparse_layer(self, i: int) -> bool:
        """Whether layer i routes over experts (transformers' Qwen2-MoE rule; every layer for Mixtral)."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % max(self.decoder_sparse_step, 1) == 0)


@dataclasses.dataclass(frozen=True)
class ExpertAct:
    """The experts' gated activation on gate|up [..., 2I] -> [..., I]: "silu" is silu(gate) * up;
    "swiglu_clamped" (gpt-oss) clamps gate above at `limit` and up to [-limit, limit], then
    gate * sigmoid(alpha * gate) * (up + 1)."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gu: jax.Array) -> jax.Array:
        g, u = jnp.split(gu, 2, axis=-1)
        if self.kind == "silu":
            return jax.nn.silu(g) * u
        if self.kind == "swiglu_clamped":
            g, u = jnp.minimum(g, self.limit), jnp.clip(u, -self.limit, self.limit)
            return g * jax.nn.sigmoid(g * self.alpha) * (u + 1)
        raise ValueError(f"expert activation must be silu or swiglu_clamped, got {self.kind!r}")


SILU = ExpertAct()


def route(logits: jax.Array, k: int, router: str = "softmax_topk",
          normalize: bool = False) -> tuple[jax.Array, jax.Array]:
    """Each token's k experts and their weights from router logits [T, E] (float32): `softmax_topk`
    takes the k largest softmax probabilities (renormalised to sum to 1 with `normalize`: Mixtral,
    Qwen3-MoE), `topk_softmax` the softmax of the k largest logits. Ties go to the lower expert
    index. Returns (weights float32 [T, k], expert ids int32 [T, k]), weights in descending order."""
    logits = logits.astype(jnp.float32)
    if router == "softmax_topk":
        w, idx = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
        if normalize:
            w = w / jnp.sum(w, axis=-1, keepdims=True)
    elif router == "topk_softmax":
        top, idx = jax.lax.top_k(logits, k)
        w = jax.nn.softmax(top, axis=-1)
    else:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    return w, idx.astype(jnp.int32)


def expert_ffn(h: jax.Array, weights: jax.Array, idx: jax.Array, gate_up: jax.Array, down: jax.Array,
               impl: str = DEFAULT_IMPL, num_tokens: jax.Array | None = None, kernels: Kernels = XLA,
               act: ExpertAct = SILU, gate_up_bias: jax.Array | None = None,
               down_bias: jax.Array | None = None) -> jax.Array:
    """sum_j weights[t, j] * down_e(silu(gate_e(h_t)) * up_e(h_t)) for e = idx[t, j]: h [T, H],
    weights / idx [T, k], gate_up [E, 2I, H], down [E, H, I] -> [T, H] in h's dtype (float32 sums).
    `act` replaces silu(gate) * up; `gate_up_bias` [E, 2I] and `down_bias` [E, H] (gpt-oss) are
    added to each expert's projections.

    `num_tokens` (traced): the rows that are real tokens (the rest are a bucket's padding, whose
    rows come back unspecified). `kernels` pick the GEMM of `tiles` and `dense` (the CPU kernel on
    an x86-64 CPU). Implementations (docs/PERF.md, Mixture of experts, has their measurements):
    `tiles` (the default): the real pairs sorted by expert into tiles of TILE rows, one expert per
    tile, a loop over the used tiles only; `pairs`: one pair at a time, its expert read in place;
    `dense`: one GEMM per expert over every token; `ragged`: jax.lax.ragged_dot over the sorted
    pairs; `gather`: each token's experts' weights gathered.

    gate_up / down may be stacks of GGML blocks [E, N, K / W, bytes] (a GGUF's or gpt-oss's MXFP4
    experts kept as stored): `tiles` and `dense` hand one expert's blocks to the GEMM (the CPU kernel
    widens them as it reads them; XLA's dot dequantises them first), `pairs` and `gather` dequantise
    the experts they index, `ragged` the whole stack, inside the program."""
    T, k = idx.shape
    E = gate_up.shape[0]
    f32 = jnp.float32

    def floats(w: jax.Array) -> jax.Array:   # GGML blocks (a kept expert stack's) dequantised in the program
        return ggml_blocks.dequantize(w).astype(h.dtype) if ggml_blocks.format_of(w) else w

    def bias(b: jax.Array | None, e: jax.Array) -> jax.Array | float:   # expert e's (or ids') bias rows
        return 0.0 if b is None else jnp.take(b, e, axis=0).astype(f32)

    if impl == "pairs":   # one (token, expert) pair at a time, real tokens only
        n = jnp.asarray(T if num_tokens is None else num_tokens, jnp.int32)
        wf = weights.astype(f32)

        def pair(p, out):
            t, j = p // k, p % k
            e = idx[t, j]
            x = jax.lax.dynamic_index_in_dim(h, t, 0, keepdims=False)
            gu = jax.lax.dot_general(floats(jax.lax.dynamic_index_in_dim(gate_up, e, 0, keepdims=False)), x,
                                     (((1,), (0,)), ((), ())), preferred_element_type=f32) + bias(gate_up_bias, e)
            y = jax.lax.dot_general(floats(jax.lax.dynamic_index_in_dim(down, e, 0, keepdims=False)),
                                    act(gu).astype(h.dtype), (((1,), (0,)), ((), ())),
                                    preferred_element_type=f32) + bias(down_bias, e)
            return out.at[t].add(wf[t, j] * y)

        out = jax.lax.fori_loop(0, n * k, pair, jnp.zeros(h.shape, f32))
        return out.astype(h.dtype)
    if impl == "tiles":   # a grouped matmul of tiles of TILE rows, each tile one expert's, real tokens only
        n = jnp.asarray(T if num_tokens is None else num_tokens, jnp.int32)
        P, m, E_ = T * k, TILE, gate_up.shape[0]
        real = jnp.arange(P) < n * k
        flat = jnp.where(real, idx.reshape(-1), E_)            # padding pairs sort last, to no expert
        order = jnp.argsort(flat, stable=True)
        sizes = jnp.zeros((E_ + 1,), jnp.int32).at[flat].add(1)[:E_]
        padded = (sizes + m - 1) // m * m                      # each expert's rows padded to whole tiles
        pstart = jnp.cumsum(padded) - padded
        start = jnp.cumsum(sizes) - sizes
        e_sorted = flat[order]
        e_safe = jnp.minimum(e_sorted, E_ - 1)
        dest = jnp.where(e_sorted < E_, pstart[e_safe] + jnp.arange(P) - start[e_safe], -1)
        n_tiles_max = -(-P // m) + E_
        R = n_tiles_max * m
        buf = jnp.zeros((R, h.shape[1]), h.dtype).at[dest].set(h[order // k], mode="drop")
        ends = jnp.cumsum(padded)
        # compare_all: one fused comparison, where the default scan is a loop of small ops (a GPU's worst case)
        tile_expert = jnp.minimum(jnp.searchsorted(ends, jnp.arange(n_tiles_max) * m, side="right",
                                                   method="compare_all"), E_ - 1)
        n_tiles = ends[-1] // m

        def tile(i, out):
            e = tile_expert[i]
            x = jax.lax.dynamic_slice_in_dim(buf, i * m, m)
            gu = matmul_wt(x, jax.lax.dynamic_index_in_dim(gate_up, e, 0, keepdims=False), kernels)
            gu = gu + bias(gate_up_bias, e)
            y = matmul_wt(act(gu).astype(h.dtype), jax.lax.dynamic_index_in_dim(down, e, 0, keepdims=False), kernels)
            y = y + bias(down_bias, e)
            return jax.lax.dynamic_update_slice_in_dim(out, y, i * m, 0)

        ys = jax.lax.fori_loop(0, n_tiles, tile, jnp.zeros((R, h.shape[1]), f32))
        y_sorted = jnp.where((dest >= 0)[:, None], ys[jnp.maximum(dest, 0)], 0)
        y = jnp.zeros((P, h.shape[1]), f32).at[order].set(y_sorted).reshape(T, k, -1)
    elif impl == "ragged":
        flat = idx.reshape(-1)                           # pair p = t * k + j
        order = jnp.argsort(flat, stable=True)           # pairs sorted by expert
        sizes = jnp.zeros((E,), jnp.int32).at[flat].add(1)
        rows = h[order // k]                             # [T*k, H]
        dn = jax.lax.RaggedDotDimensionNumbers(         # contract H with each expert's [out, in] rows
            dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
        e_sorted = flat[order]
        gu = jax.lax.ragged_dot_general(rows, floats(gate_up), sizes, dn, preferred_element_type=f32)
        gu = gu + bias(gate_up_bias, e_sorted)
        y = jax.lax.ragged_dot_general(act(gu).astype(h.dtype), floats(down), sizes, dn, preferred_element_type=f32)
        y = y + bias(down_bias, e_sorted)
        y = jnp.zeros_like(y).at[order].set(y).reshape(T, k, -1)   # back to pair order
    elif impl == "dense":   # one GEMM per expert over every token (`kernels`' GEMM: the CPU kernel's)
        combine = jnp.zeros((T, E), f32).at[jnp.arange(T)[:, None], idx].add(weights.astype(f32))
        out = jnp.zeros(h.shape, f32)
        for e in range(E):
            gu = matmul_wt(h, gate_up[e], kernels) + bias(gate_up_bias, e)
            g = matmul_wt(act(gu).astype(h.dtype), down[e], kernels) + bias(down_bias, e)
            out = out + combine[:, e:e + 1] * g
        return out.astype(h.dtype)
    elif impl == "gather":
        gu = jnp.einsum("th,tkgh->tkg", h, floats(gate_up[idx]), preferred_element_type=f32) + bias(gate_up_bias, idx)
        y = jnp.einsum("tki,tkhi->tkh", act(gu).astype(h.dtype), floats(down[idx]),
                       preferred_element_type=f32) + bias(down_bias, idx)
    else:
        raise ValueError(f"impl must be one of {EXPERT_IMPLS}, got {impl!r}")
    return jnp.einsum("tk,tkh->th", weights.astype(f32), y).astype(h.dtype)


class SparseMLP(nnx.Module):
    """One sparse layer's router, stacked experts, optional shared expert and (gpt-oss) biases."""

    def __init__(self, cfg: MoEConfig, dtype: jnp.dtype, key: Any, tp: TensorParallel):
        E, H = cfg.num_experts, cfg.hidden_size
        I = tp.padded(expert_width(cfg))   # the intermediate axes, padded to the shards (shard-major)
        init = nnx.initializers.normal(0.02)
        self.router = nnx.Param(init(key(), (E, H), dtype), axes=(None, "embed"))
        self.gate_up = nnx.Param(init(key(), (E, 2 * I, H), dtype), axes=("experts", "gate_up", "embed"))
        self.down = nnx.Param(init(key(), (E, H, I), dtype), axes=("experts", "embed", "mlp"))
        S = tp.padded(cfg.shared_expert_intermediate_size)
        self.shared_gate_up = Matrix(init(key(), (2 * S, H), dtype), axes=("gate_up", "embed")) if S else None
        self.shared_down = Matrix(init(key(), (H, S), dtype), axes=("embed", "mlp")) if S else None
        self.shared_gate = nnx.Param(init(key(), (1, H), dtype), axes=(None, "embed")) if S else None
        B = cfg.expert_bias
        self.router_bias = nnx.Param(jnp.zeros((E,), dtype), axes=(None,)) if B else None
        self.gate_up_bias = nnx.Param(jnp.zeros((E, 2 * I), dtype), axes=("experts", "gate_up")) if B else None
        self.down_bias = nnx.Param(jnp.zeros((E, H), dtype), axes=("experts", "embed")) if B else None

    def arrays(self) -> dict[str, jax.Array]:
        return {n: p[...] for n, p in vars(self).items() if isinstance(p, nnx.Param)}


class DenseMLP(nnx.Module):
    """A dense layer's gate|up and down projections (Qwen2-MoE's `mlp_only_layers`)."""

    def __init__(self, cfg: MoEConfig, dtype: jnp.dtype, key: Any, tp: TensorParallel):
        I, H = tp.padded(cfg.intermediate_size), cfg.hidden_size
        init = nnx.initializers.normal(0.02)
        self.gate_up = Matrix(init(key(), (2 * I, H), dtype), axes=("gate_up", "embed"))
        self.down = Matrix(init(key(), (H, I), dtype), axes=("embed", "mlp"))

    def arrays(self) -> dict[str, jax.Array]:
        return {n: p[...] for n, p in vars(self).items() if isinstance(p, nnx.Param)}


class MoELayers(DecoderLayers):
    """DecoderLayers' attention weights, and per layer a SparseMLP or a DenseMLP (`mlp`)."""

    MATRICES = ("qkv_proj", "o_proj")

    def __init__(self, cfg: MoEConfig, dtype: jnp.dtype, rngs: nnx.Rngs, tp: TensorParallel):
        super().__init__(cfg, dtype, rngs, tp)
        self.mlp = nnx.List([SparseMLP(cfg, dtype, rngs.params, tp) if cfg.is_sparse_layer(i)
                             else DenseMLP(cfg, dtype, rngs.params, tp) for i in range(cfg.num_layers)])


def expert_width(cfg: MoEConfig) -> int:
    """Each routed expert's intermediate size I."""
    return cfg.moe_intermediate_size or cfg.intermediate_size


def shard_putter(tp: TensorParallel, dtype: Any) -> Callable[..., None]:
    """`put(param, value, index=None, axis=0)`: set a parameter from a checkpoint value; on N > 1
    shards `value` is first reordered shard-major along `axis` (`index`: tensor_parallel's
    fused_index / split_index; -1 a zero pad) and kept on the host for the engine to place."""
    on_host = tp.n > 1
    logged = []

    def put(param: nnx.Param, value: np.ndarray, index: np.ndarray | None = None, axis: int = 0) -> None:
        if on_host and index is not None:
            fmt = ggml_blocks.format_of(value)
            value = take(value, index, axis, tp.n)
            if fmt and not ggml_blocks.format_of(value) and not logged:
                logged.append(fmt)
                log.info("tensor parallel: %d shards cut %s blocks of %s (shape %s): dequantised at load",
                         tp.n, fmt, param.get_metadata().get("axes"), tuple(value.shape))
        got = ggml_blocks.matrix_shape(value) if ggml_blocks.format_of(value) else tuple(value.shape)
        if got != tuple(param.shape):
            raise ValueError(f"shape {value.shape} where {param.shape} was expected")
        param.set_value(stored(value, dtype, on_host=on_host))
    return put


def check_moe_config(cfg: MoEConfig) -> None:
    """A ModelLoadError for a config this module cannot run."""
    if cfg.num_experts < 1:
        raise ModelLoadError(f"{cfg.architecture}: the config names no experts "
                             "('num_local_experts' / 'num_experts')")
    if cfg.router not in ROUTERS:
        raise ModelLoadError(f"{cfg.architecture}: router {cfg.router!r} is not one of {', '.join(ROUTERS)}")


class MoELM(DecoderLM):
    """A mixture-of-experts causal LM (module docstring); the model contract of model/base.py."""

    layers_class = MoELayers
    expert_impl = DEFAULT_IMPL

    def __init__(self, config: MoEConfig, options: ModelOptions = ModelOptions(), *, rngs: nnx.Rngs):
        check_moe_config(config)
        super().__init__(config, options, rngs=rngs)

    def lora_targets(self):
        raise ModelLoadError(f"--max-loras: LoRA adapters are not supported for mixture-of-experts models "
                             f"({self.config.architecture}) yet")

    def enable_lora(self, options) -> None:
        self.lora_targets()

    def _mlp(self, h, proj, i, meta):
        """Layer i's feed-forward block, sparse or dense: row-parallel as a whole, its shards' partial
        outputs (experts and shared expert added first) reduced once."""
        blocks = [m.arrays() for m in self.layers.mlp]
        n = meta.query_start_loc[meta.num_seqs]   # the real tokens (the bucket's padding follows them)
        sparse = lambda h, w: self._sparse(h, w, n, proj)  # noqa: E731
        fns = [sparse if self.config.is_sparse_layer(j) else self._dense for j in range(len(blocks))]
        if isinstance(i, int):
            return proj.reduce(fns[i](h, blocks[i]))
        return proj.reduce(jax.lax.switch(i, [lambda h, b, j=j: fns[j](h, b[j]) for j in range(len(blocks))],
                                          h, blocks))

    def _dense(self, h: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
        """A dense MLP on this shard's rows: its partial output (`_mlp` sums the shards')."""
        kernels = self.options.kernels
        gate, up = jnp.split(linear(h, w["gate_up"], kernels=kernels), 2, axis=-1)
        return linear(jax.nn.silu(gate) * up, w["down"], kernels=kernels)

    def _sparse(self, h: jax.Array, w: dict[str, jax.Array], num_tokens: jax.Array, proj: Projections) -> jax.Array:
        """Routing (the same on every shard) and the experts on this shard's rows, plus the gated
        shared expert's: a partial output (`_mlp` sums the shards', the down bias counted once)."""
        cfg = self.config
        logits = jnp.einsum("th,eh->te", h, w["router"], preferred_element_type=jnp.float32)
        if "router_bias" in w:
            logits = logits + w["router_bias"].astype(jnp.float32)
        weights, idx = route(logits, cfg.num_experts_per_tok, cfg.router, cfg.norm_topk_prob)
        act = ExpertAct(cfg.expert_act, cfg.swiglu_alpha, cfg.swiglu_limit)
        out = expert_ffn(h, weights, idx, w["gate_up"], w["down"], self.expert_impl, num_tokens,
                         self.options.kernels, act, w.get("gate_up_bias"),
                         proj.once(w["down_bias"]) if "down_bias" in w else None)
        if "shared_gate_up" in w:
            shared = self._dense(h, {"gate_up": w["shared_gate_up"], "down": w["shared_down"]})
            gate = jax.nn.sigmoid(jnp.einsum("th,oh->to", h, w["shared_gate"], preferred_element_type=jnp.float32))
            out = out + (gate * shared.astype(jnp.float32)).astype(h.dtype)
        return out

    @classmethod
    def from_hf_tensors(cls, config: MoEConfig, weights: WeightSource,
                        options: ModelOptions = ModelOptions()) -> "MoELM":
        """Build from HF-named tensors: attention as DecoderLM, the experts stacked at load from
        per-expert tensors (Mixtral `block_sparse_moe.experts.{e}.w1/w2/w3`, Qwen `mlp.experts.{e}.
        gate_proj/up_proj/down_proj`) or taken whole where the checkpoint stacks them (GGUF:
        `mlp.experts.{gate,up,down}_proj.weight` [E, out, in], model/formats/gguf_loader.py)."""
        model = super().from_hf_tensors(config, weights, options)
        cls._load_experts(model, config, weights, options)
        return model

    @classmethod
    def _load_experts(cls, model: "MoELM", config: MoEConfig, weights: WeightSource,
                      options: ModelOptions) -> None:
        """Set every layer's feed-forward weights (`mlp`) from HF-named tensors."""
        mixtral = config.architecture == "MixtralForCausalLM"
        moe = "block_sparse_moe" if mixtral else "mlp"
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        tp, I, S = model.tp, expert_width(config), config.shared_expert_intermediate_size
        put = shard_putter(tp, options.dtype)

        def experts(pre: str, *names: str) -> np.ndarray:   # [E, out, in] of `names` joined along out
            whole = [f"{pre}.experts.{name}.weight" for name in names]
            if all(w in weights for w in whole):   # a GGUF's stacks: kept as GGML blocks where they can be
                return weights.stack(*whole)
            return np.concatenate([np.stack([weights.tensor(f"{pre}.experts.{e}.{name}.weight")
                                             for e in range(config.num_experts)]) for name in names], axis=1)

        for i, mlp in enumerate(model.layers.mlp):
            pre = f"model.layers.{i}.{moe}"
            if isinstance(mlp, DenseMLP):
                pre = f"model.layers.{i}.mlp"
                put(mlp.gate_up, weights.matrix(f"{pre}.gate_proj.weight", f"{pre}.up_proj.weight"),
                    tp.gate_up_index(config), 0)
                put(mlp.down, weights.matrix(f"{pre}.down_proj.weight"), tp.down_index(config), 1)
                continue
            put(mlp.router, weights.tensor(f"{pre}.gate.weight"))
            put(mlp.gate_up, experts(pre, names[0], names[1]), tp.fused_index(I), 1)
            put(mlp.down, experts(pre, names[2]), tp.split_index(I), 2)
            if mlp.shared_gate_up is not None:
                s = f"{pre}.shared_expert"
                put(mlp.shared_gate_up, weights.matrix(f"{s}.gate_proj.weight", f"{s}.up_proj.weight"),
                    tp.fused_index(S), 0)
                put(mlp.shared_down, weights.matrix(f"{s}.down_proj.weight"), tp.split_index(S), 1)
                put(mlp.shared_gate, weights.tensor(f"{pre}.shared_expert_gate.weight").reshape(1, -1))


# ------------------------------------------------------------------------------------- the family
def moe_fields(hf: Mapping[str, Any], arch: str, source: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a HF config (none for a dense one). Mixtral names its expert
    count `num_local_experts` and always renormalises the top-k weights; the Qwen MoEs name it
    `num_experts` (Qwen3-MoE configs written by transformers 5 say `num_local_experts`)."""
    experts = hf.get("num_local_experts") or hf.get("num_experts") or 0
    if not experts:
        return {}
    try:
        experts, k = int(experts), int(hf.get("num_experts_per_tok") or 0)
        mlp_only = tuple(int(i) for i in hf.get("mlp_only_layers") or ())
        fields = dict(
            num_experts=experts, num_experts_per_tok=k,
            moe_intermediate_size=int(hf.get("moe_intermediate_size") or 0),
            shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
            norm_topk_prob=True if arch == "MixtralForCausalLM" else bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=int(hf.get("decoder_sparse_step") or 1),
            mlp_only_layers=mlp_only)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{source}: bad mixture-of-experts field ({e})") from None
    if not 1 <= k <= experts:
        raise ModelLoadError(f"{source}: 'num_experts_per_tok' must be in 1..{experts} (the experts), "
                             f"got {hf.get('num_experts_per_tok')!r}")
    return fields


def _parse(hf: Mapping[str, Any], fields: dict[str, Any], source: str) -> dict[str, Any]:
    """MoEConfig fields of a Mixtral / Qwen2-MoE / Qwen3-MoE config; Qwen2-MoE's q/k/v carry biases unless the
    config says otherwise, Qwen3-MoE norms q and k."""
    arch = fields["architecture"]
    return {**moe_fields(hf, arch, source), "attention_bias": attention_bias(hf, default=arch == "Qwen2MoeForCausalLM"),
            "qk_norm": arch == "Qwen3MoeForCausalLM"}


def _gguf_config(arch: str, meta: Metadata, cfg: dict[str, Any], raw: Mapping[str, Any]) -> dict[str, Any]:
    """The experts as llama.cpp writes them: a Mixtral (a `llama` file) counts them as `num_local_experts`, the
    Qwen MoEs as `num_experts`; the layers without a router are dense."""
    out: dict[str, Any] = {} if arch == "llama" else {"use_sliding_window": False}
    experts = meta.get(f"{arch}.expert_count")
    if not experts:
        return out
    out["num_local_experts" if arch == "llama" else "num_experts"] = int(experts)
    out["num_experts_per_tok"] = int(meta.need(f"{arch}.expert_used_count"))
    # llama.cpp renormalises the top-k weights of qwen3moe, not of qwen2moe, unless the file says
    out["norm_topk_prob"] = bool(meta.get(f"{arch}.expert_weights_norm", arch == "qwen3moe"))
    out["mlp_only_layers"] = [i for i in range(cfg["num_hidden_layers"])   # dense layers: no router
                              if f"blk.{i}.ffn_gate_inp.weight" not in raw]
    return out


def _gguf_names(moe: str, gate: str, up: str, down: str) -> dict[str, str]:
    """GGUF -> HF names of the router, the stacked experts ([E, out, in], as moe.py reads them whole; quantised
    ones dequantised at load) and Qwen2-MoE's shared expert; `moe` is Mixtral's `block_sparse_moe` or the Qwen
    MoEs' `mlp`, the experts' leaves Mixtral's w1/w3/w2 or gate/up/down_proj."""
    return {"ffn_gate_inp": f"{moe}.gate", "ffn_gate_exps": f"{moe}.experts.{gate}",
            "ffn_up_exps": f"{moe}.experts.{up}", "ffn_down_exps": f"{moe}.experts.{down}",
            "ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
            "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj"}


_GGUF_METADATA = {"expert_feed_forward_length": "moe_intermediate_size",
                  "expert_shared_feed_forward_length": "shared_expert_intermediate_size"}
_QWEN_NAMES = _gguf_names("mlp", "gate_proj", "up_proj", "down_proj")
FAMILY = Family(config=MoEConfig, parse=_parse, gguf=(
    # llama.cpp's converter writes a Mixtral as a `llama` file with expert tensors
    GGUFNames("llama", "MixtralForCausalLM", experts=True, metadata=_GGUF_METADATA, config=_gguf_config,
              layer_names=_gguf_names("block_sparse_moe", "w1", "w3", "w2"), permuted_qk=True),
    GGUFNames("qwen2moe", "Qwen2MoeForCausalLM", experts=True, metadata=_GGUF_METADATA, config=_gguf_config,
              layer_names=_QWEN_NAMES),
    GGUFNames("qwen3moe", "Qwen3MoeForCausalLM", experts=True, metadata=_GGUF_METADATA, config=_gguf_config,
              layer_names=_QWEN_NAMES)))
