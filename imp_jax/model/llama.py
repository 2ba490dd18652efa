"""The decoder family: Llama 2/3.x, SmolLM2, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm).

Per-layer weights are stacked along a leading layer axis so the layer loop can be a
`lax.scan` (fast to compile) or unrolled (fast to run on CPU); `layer_loop` picks.
Projections are fused (q|k|v and gate|up) so each is one GEMM.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from imp_jax.kernels_pallas import AttentionMetadata, ragged_paged_attention
from imp_jax.model.config import ModelConfig
from imp_jax.model.layers import apply_rope, linear, rms_norm, rope_tables
from imp_jax.model.registry import register_model

KVCache = tuple[jax.Array, jax.Array]  # K and V, each [L, num_blocks, block_size, KVH, D]
LAYER_LOOPS = ("scan", "unroll")


class DecoderLayers(nnx.Module):
    """All layers' weights, stacked: each Param has a leading [num_layers] axis."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        L, E, I, D = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        qkv = cfg.q_size + 2 * cfg.kv_size
        init = nnx.initializers.normal(0.02)
        key = rngs.params
        self.input_norm = nnx.Param(jnp.ones((L, E), dtype))
        self.qkv_proj = nnx.Param(init(key(), (L, E, qkv), dtype))
        self.qkv_bias = nnx.Param(jnp.zeros((L, qkv), dtype)) if cfg.attention_bias else None
        self.q_norm = nnx.Param(jnp.ones((L, D), dtype)) if cfg.qk_norm else None
        self.k_norm = nnx.Param(jnp.ones((L, D), dtype)) if cfg.qk_norm else None
        self.o_proj = nnx.Param(init(key(), (L, cfg.q_size, E), dtype))
        self.post_norm = nnx.Param(jnp.ones((L, E), dtype))
        self.gate_up_proj = nnx.Param(init(key(), (L, E, 2 * I), dtype))
        self.down_proj = nnx.Param(init(key(), (L, I, E), dtype))

    def arrays(self) -> dict[str, jax.Array]:
        """The stacked weights as a plain dict (absent optional weights left out)."""
        return {name: p[...] for name, p in vars(self).items() if isinstance(p, nnx.Param)}


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
                        nnx.Param(init(rngs.params(), (config.hidden_size, config.vocab_size), dtype)))

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of K (and of V): [num_layers, num_blocks, block_size, num_kv_heads, head_dim]."""
        c = self.config
        return (c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim)

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv: KVCache,
                 meta: AttentionMetadata) -> tuple[jax.Array, KVCache]:
        """Hidden states [T, hidden] (before the final norm) and the updated KV cache."""
        cfg = self.config
        x = self.embed[...][input_ids]
        cos, sin = rope_tables(positions, cfg.rope_inv_freq())
        weights = self.layers.arrays()

        def layer(carry, xs):
            x, k_cache, v_cache = carry
            w, i = xs
            x, k_cache, v_cache = self._layer(x, w, i, cos, sin, k_cache, v_cache, meta)
            return (x, k_cache, v_cache), None

        carry = (x, *kv)
        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        if self.layer_loop == "scan":
            carry, _ = jax.lax.scan(layer, carry, (weights, layer_ids))
        else:
            for i in range(cfg.num_layers):
                carry, _ = layer(carry, ({k: w[i] for k, w in weights.items()}, i))
        x, k_cache, v_cache = carry
        return x, (k_cache, v_cache)

    def _layer(self, x, w, i, cos, sin, k_cache, v_cache, meta):
        cfg = self.config
        T = x.shape[0]
        h = rms_norm(x, w["input_norm"], cfg.rms_norm_eps)
        qkv = linear(h, w["qkv_proj"], w.get("qkv_bias"))
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
        x = x + linear(attn.reshape(T, cfg.q_size), w["o_proj"])
        h = rms_norm(x, w["post_norm"], cfg.rms_norm_eps)
        gate, up = jnp.split(linear(h, w["gate_up_proj"]), 2, axis=-1)
        x = x + linear(jax.nn.silu(gate) * up, w["down_proj"])
        return x, k_cache, v_cache

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final norm + LM head on the rows to sample: float32 [R, vocab]."""
        h = rms_norm(hidden, self.norm[...], self.config.rms_norm_eps)
        if self.lm_head is None:  # tied: contract with the embedding's hidden axis, no transpose copy
            return jax.lax.dot_general(h, self.embed[...], (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32)
        return jnp.dot(h, self.lm_head[...], preferred_element_type=jnp.float32)

    @classmethod
    def from_hf_tensors(cls, config: ModelConfig, get: Callable[[str], np.ndarray], *,
                        dtype: jnp.dtype = jnp.float32, layer_loop: str = "scan") -> "DecoderLM":
        """Build from HF-named tensors (`get(name)` -> numpy [out, in] for linears) without random init."""
        model = nnx.eval_shape(lambda: cls(config, dtype=dtype, rngs=nnx.Rngs(0), layer_loop=layer_loop))

        def put(param: nnx.Param, value: np.ndarray) -> None:
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"shape {value.shape} where {param.shape} was expected")
            param.set_value(jnp.asarray(value, dtype))

        pre = "model.layers.{}."
        def stacked(*names: str, transpose: bool = True) -> np.ndarray:
            per_layer = []
            for i in range(config.num_layers):
                parts = [np.asarray(get(pre.format(i) + n), np.float32) for n in names]
                parts = [p.T if transpose else p for p in parts]
                per_layer.append(np.concatenate(parts, axis=-1))
            return np.stack(per_layer)

        ly = model.layers
        put(model.embed, get("model.embed_tokens.weight"))
        put(model.norm, get("model.norm.weight"))
        if model.lm_head is not None:
            put(model.lm_head, np.asarray(get("lm_head.weight")).T)
        put(ly.input_norm, stacked("input_layernorm.weight", transpose=False))
        put(ly.post_norm, stacked("post_attention_layernorm.weight", transpose=False))
        put(ly.qkv_proj, stacked(*(f"self_attn.{p}_proj.weight" for p in "qkv")))
        put(ly.o_proj, stacked("self_attn.o_proj.weight"))
        put(ly.gate_up_proj, stacked("mlp.gate_proj.weight", "mlp.up_proj.weight"))
        put(ly.down_proj, stacked("mlp.down_proj.weight"))
        if ly.qkv_bias is not None:
            put(ly.qkv_bias, stacked(*(f"self_attn.{p}_proj.bias" for p in "qkv"), transpose=False))
        if ly.q_norm is not None:
            put(ly.q_norm, stacked("self_attn.q_norm.weight", transpose=False))
            put(ly.k_norm, stacked("self_attn.k_norm.weight", transpose=False))
        return model
