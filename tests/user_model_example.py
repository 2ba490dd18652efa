"""A complete user model, served with `--model-class user_model_example:OneLayerLM` (the example of
docs/ARCHITECTURE.md): the first attention layer of a Llama checkpoint and its tied LM head."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from imp_jax.kernels_pallas import AttentionMetadata, ragged_paged_attention
from imp_jax.model.base import KVCache, ModelOptions
from imp_jax.model.config import ModelConfig
from imp_jax.model.layers import apply_rope, embed, linear, rms_norm, rope_tables
from imp_jax.model.weights import Matrix, WeightSource, stored


class OneLayerLM(nnx.Module):
    """x = embed(ids); x += attention(x); logits = norm(x) @ embed.T."""

    def __init__(self, config: ModelConfig, options: ModelOptions = ModelOptions(), *, rngs: nnx.Rngs):
        self.config, self.options = config, options
        E, V, dtype = config.hidden_size, config.vocab_size, options.dtype
        init = nnx.initializers.normal(0.02)
        self.embed = Matrix(init(rngs.params(), (V, E), dtype), axes=("vocab", "embed"))
        self.q = Matrix(init(rngs.params(), (config.q_size, E), dtype), axes=("heads", "embed"))
        self.k = Matrix(init(rngs.params(), (config.kv_size, E), dtype), axes=("kv_heads", "embed"))
        self.v = Matrix(init(rngs.params(), (config.kv_size, E), dtype), axes=("kv_heads", "embed"))
        self.o = Matrix(init(rngs.params(), (E, config.q_size), dtype), axes=("embed", "heads"))
        self.norm = nnx.Param(jnp.ones((E,), dtype), axes=("embed",))

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        c = self.config
        return (1, num_blocks, block_size, c.num_kv_heads, c.head_dim)   # one layer

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv: KVCache,
                 meta: AttentionMetadata) -> tuple[jax.Array, KVCache]:
        c, kernels, T = self.config, self.options.kernels, input_ids.shape[0]
        x = embed(self.embed[...], input_ids, self.options.dtype)
        cos, sin = rope_tables(positions, c.rope_inv_freq())
        heads = lambda w, n: linear(x, w[...], kernels=kernels).reshape(T, n, c.head_dim)
        q = apply_rope(heads(self.q, c.num_heads), cos, sin)
        k = apply_rope(heads(self.k, c.num_kv_heads), cos, sin)
        attn, k_cache, v_cache = ragged_paged_attention(
            q, k, heads(self.v, c.num_kv_heads), *kv, meta, 0, sm_scale=c.head_dim ** -0.5, kernels=kernels)
        return x + linear(attn.reshape(T, c.q_size), self.o[...], kernels=kernels), (k_cache, v_cache)

    def logits(self, hidden: jax.Array) -> jax.Array:
        h = rms_norm(hidden, self.norm[...], self.config.rms_norm_eps)
        return linear(h, self.embed[...], kernels=self.options.kernels, out_dtype=jnp.float32)

    @classmethod
    def from_hf_tensors(cls, config: ModelConfig, weights: WeightSource,
                        options: ModelOptions = ModelOptions()) -> "OneLayerLM":
        model = nnx.eval_shape(lambda: cls(config, options, rngs=nnx.Rngs(0)))
        attn = "model.layers.0.self_attn.{}_proj.weight"
        for param, name in ((model.embed, "model.embed_tokens.weight"), (model.q, attn.format("q")),
                            (model.k, attn.format("k")), (model.v, attn.format("v")), (model.o, attn.format("o"))):
            param.set_value(stored(weights.matrix(name), options.dtype))
        model.norm.set_value(stored(weights.tensor("model.norm.weight"), options.dtype))
        return model
