"""The decoder family: Llama 2/3.x, SmolLM2, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm).

Projections are fused (q|k|v and gate|up) so each is one GEMM, and kept in HF's [out, in]
layout, which XLA's CPU GEMMs ran ~15% faster than [in, out] at 1 and 32 rows.
Each layer's matrices are their own arrays: under the `scan` layer loop a projection picks
its layer's matrix with `lax.switch`, so the GEMM reads the weight in place, where slicing a
stacked [L, ...] array copied every layer's weights on every step (docs/PERF.md). Norm scales
and biases are small and stay stacked along a leading layer axis.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from imp_jax.kernels_pallas import AttentionMetadata, ragged_paged_attention
from imp_jax.model.config import ModelConfig
from imp_jax.kernels_pallas import quant
from imp_jax.model.layers import (apply_rope, embed, exact_bf16, join_blocks, keeps_blocks, linear,
                                  rms_norm, rope_tables)
from imp_jax.model.registry import register_model

KVCache = tuple[jax.Array, jax.Array]  # K and V, each [L, num_blocks, block_size, KVH, D]
LAYER_LOOPS = ("scan", "unroll")
MATRICES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class DecoderLayers(nnx.Module):
    """All layers' weights: matrices as one [out, in] Param per layer, vectors stacked [L, ...]."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        L, E, I, D = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        qkv = cfg.q_size + 2 * cfg.kv_size
        init = nnx.initializers.normal(0.02)
        key = rngs.params

        def per_layer(shape: tuple[int, int]) -> nnx.List:
            return nnx.List([nnx.Param(init(key(), shape, dtype)) for _ in range(L)])

        self.input_norm = nnx.Param(jnp.ones((L, E), dtype))
        self.qkv_proj = per_layer((qkv, E))
        self.qkv_bias = nnx.Param(jnp.zeros((L, qkv), dtype)) if cfg.attention_bias else None
        self.q_norm = nnx.Param(jnp.ones((L, D), dtype)) if cfg.qk_norm else None
        self.k_norm = nnx.Param(jnp.ones((L, D), dtype)) if cfg.qk_norm else None
        self.o_proj = per_layer((E, cfg.q_size))
        self.post_norm = nnx.Param(jnp.ones((L, E), dtype))
        self.gate_up_proj = per_layer((2 * I, E))
        self.down_proj = per_layer((E, I))

    def vectors(self) -> dict[str, jax.Array]:
        """The stacked [L, ...] norm scales and biases (absent optional ones left out)."""
        return {name: p[...] for name, p in vars(self).items() if isinstance(p, nnx.Param)}

    def matrices(self) -> dict[str, tuple[jax.Array, ...]]:
        """Each projection's per-layer [out, in] matrices."""
        return {name: tuple(p[...] for p in getattr(self, name)) for name in MATRICES}

    def arrays(self) -> dict[str, jax.Array | tuple[jax.Array, ...]]:
        """Every weight by name: vectors stacked, matrices as per-layer tuples."""
        return {**self.vectors(), **self.matrices()}


def layer_linear(x: jax.Array, ws: tuple[jax.Array, ...], i: jax.Array | int,
                 b: jax.Array | None = None) -> jax.Array:
    """`linear(x, ws[i], b)` for a static or traced layer index, never copying ws[i]."""
    if isinstance(i, int):
        return linear(x, ws[i], b)
    branches = [lambda x, ws, b, j=j: linear(x, ws[j], b) for j in range(len(ws))]
    return jax.lax.switch(i, branches, x, ws, b)


@register_model("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
class DecoderLM(nnx.Module):
    """A causal LM over a flat ragged token batch with a paged KV cache (see DESIGN.md, Contracts)."""

    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype = jnp.float32,
                 rngs: nnx.Rngs, layer_loop: str = "scan"):
        if layer_loop not in LAYER_LOOPS:
            raise ValueError(f"layer_loop must be one of {LAYER_LOOPS}, got {layer_loop!r}")
        self.config = config
        self.dtype = dtype
        self.layer_loop = layer_loop
        init = nnx.initializers.normal(0.02)
        self.embed = nnx.Param(init(rngs.params(), (config.vocab_size, config.hidden_size), dtype))
        self.layers = DecoderLayers(config, dtype, rngs)
        self.norm = nnx.Param(jnp.ones((config.hidden_size,), dtype))
        self.lm_head = (None if config.tie_word_embeddings else
                        nnx.Param(init(rngs.params(), (config.vocab_size, config.hidden_size), dtype)))

    def keep_exact_bf16(self) -> int:
        """Keep the projection matrices, the embedding and the LM head as bfloat16 where that is
        exact and pays (`layers.exact_bf16`: a bf16 checkpoint run in float32 on a CPU with the
        GEMM kernel). The loader calls it once the weights are in; returns the bytes saved."""
        params = [p for name in MATRICES for p in getattr(self.layers, name)]
        params += [self.embed] + ([self.lm_head] if self.lm_head is not None else [])
        saved = 0
        for p in params:
            narrowed = exact_bf16(p[...])
            if narrowed.dtype != p[...].dtype:
                saved += p[...].nbytes - narrowed.nbytes
                p.set_value(narrowed)
        return saved

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of K (and of V): [num_layers, num_blocks, block_size, num_kv_heads, head_dim]."""
        c = self.config
        return (c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim)

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv: KVCache,
                 meta: AttentionMetadata) -> tuple[jax.Array, KVCache]:
        """Hidden states [T, hidden] (before the final norm) and the updated KV cache."""
        cfg = self.config
        x = embed(self.embed[...], input_ids, self.dtype)   # the table may be kept narrow
        cos, sin = rope_tables(positions, cfg.rope_inv_freq())
        vectors, matrices = self.layers.vectors(), self.layers.matrices()

        def layer(carry, xs):
            x, k_cache, v_cache = carry
            w, i = xs
            x, k_cache, v_cache = self._layer(x, w, matrices, i, cos, sin, k_cache, v_cache, meta)
            return (x, k_cache, v_cache), None

        carry = (x, *kv)
        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        if self.layer_loop == "scan":
            carry, _ = jax.lax.scan(layer, carry, (vectors, layer_ids))
        else:
            for i in range(cfg.num_layers):
                carry, _ = layer(carry, ({k: w[i] for k, w in vectors.items()}, i))
        x, k_cache, v_cache = carry
        return x, (k_cache, v_cache)

    def _layer(self, x, w, mats, i, cos, sin, k_cache, v_cache, meta):
        """One decoder layer; `w` holds layer i's vectors, `mats` every layer's matrices."""
        cfg = self.config
        T = x.shape[0]
        h = rms_norm(x, w["input_norm"], cfg.rms_norm_eps)
        qkv = layer_linear(h, mats["qkv_proj"], i, w.get("qkv_bias"))
        q, k, v = jnp.split(qkv, [cfg.q_size, cfg.q_size + cfg.kv_size], axis=-1)
        q = q.reshape(T, cfg.num_heads, cfg.head_dim)
        k = k.reshape(T, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, w["k_norm"], cfg.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        attn, k_cache, v_cache = ragged_paged_attention(
            q, k, v, k_cache, v_cache, meta, i, sm_scale=cfg.head_dim ** -0.5,
            sliding_window=cfg.sliding_window)
        x = x + layer_linear(attn.reshape(T, cfg.q_size), mats["o_proj"], i)
        h = rms_norm(x, w["post_norm"], cfg.rms_norm_eps)
        gate, up = jnp.split(layer_linear(h, mats["gate_up_proj"], i), 2, axis=-1)
        x = x + layer_linear(jax.nn.silu(gate) * up, mats["down_proj"], i)
        return x, k_cache, v_cache

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final norm + LM head on the rows to sample: float32 [R, vocab]."""
        h = rms_norm(hidden, self.norm[...], self.config.rms_norm_eps)
        head = self.embed if self.lm_head is None else self.lm_head   # both [vocab, hidden]
        return linear(h, head[...], out_dtype=jnp.float32)

    @classmethod
    def from_hf_tensors(cls, config: ModelConfig, get: Callable[[str], np.ndarray], *,
                        dtype: jnp.dtype = jnp.float32, layer_loop: str = "scan",
                        blocks: Callable[[str], np.ndarray | None] | None = None) -> "DecoderLM":
        """Build from HF-named tensors (`get(name)` -> numpy [out, in] for linears) without random init.

        `blocks(name)`, given for a GGUF file, is a tensor's GGML blocks in a format the CPU GEMM
        kernel reads (kernels_pallas/quant.py), or None. A matrix, the embedding or the LM head
        whose parts all have them in one format is kept as blocks where `layers.keeps_blocks` says so.
        """
        model = nnx.eval_shape(lambda: cls(config, dtype=dtype, rngs=nnx.Rngs(0), layer_loop=layer_loop))

        def put(param: nnx.Param, value: np.ndarray) -> None:
            shape = quant.matrix_shape(value) if quant.format_of(value) else tuple(value.shape)
            if shape != tuple(param.shape):
                raise ValueError(f"shape {value.shape} where {param.shape} was expected")
            param.set_value(jnp.asarray(value) if value.dtype == np.uint8 else jnp.asarray(value, dtype))

        use_blocks = blocks is not None and keeps_blocks(dtype)

        def put_matrix(param: nnx.Param, names: list[str]) -> None:
            """The matrix of `names` concatenated along their output axis: blocks if kept, else float."""
            kept = join_blocks([blocks(n) for n in names]) if use_blocks else None
            put(param, kept if kept is not None else
                np.concatenate([np.asarray(get(n), np.float32) for n in names]))

        pre = "model.layers.{}."
        def stacked(*names: str) -> np.ndarray:
            """Every layer's tensors, each layer's concatenated along the first axis, stacked."""
            return np.stack([np.concatenate([np.asarray(get(pre.format(i) + n), np.float32) for n in names])
                             for i in range(config.num_layers)])

        def per_layer(params: nnx.List, *names: str) -> None:
            for i, param in enumerate(params):
                put_matrix(param, [pre.format(i) + n for n in names])

        ly = model.layers
        put_matrix(model.embed, ["model.embed_tokens.weight"])
        put(model.norm, get("model.norm.weight"))
        if model.lm_head is not None:
            put_matrix(model.lm_head, ["lm_head.weight"])
        put(ly.input_norm, stacked("input_layernorm.weight"))
        put(ly.post_norm, stacked("post_attention_layernorm.weight"))
        per_layer(ly.qkv_proj, *(f"self_attn.{p}_proj.weight" for p in "qkv"))
        per_layer(ly.o_proj, "self_attn.o_proj.weight")
        per_layer(ly.gate_up_proj, "mlp.gate_proj.weight", "mlp.up_proj.weight")
        per_layer(ly.down_proj, "mlp.down_proj.weight")
        if ly.qkv_bias is not None:
            put(ly.qkv_bias, stacked(*(f"self_attn.{p}_proj.bias" for p in "qkv")))
        if ly.q_norm is not None:
            put(ly.q_norm, stacked("self_attn.q_norm.weight"))
            put(ly.k_norm, stacked("self_attn.k_norm.weight"))
        return model
