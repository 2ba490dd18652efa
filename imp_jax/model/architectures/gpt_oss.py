"""gpt-oss (GptOssForCausalLM): model/architectures/moe.py's mixture of experts with gpt-oss's attention.

What differs from MoELM:
- attention sinks: a learned logit per head joins every softmax's denominator (and nothing to its
  numerator), passed to the attention kernels (`sinks`; every backend takes them);
- layers alternate sliding-window and full attention (`config.layer_types`, sliding first), picked
  per layer as model/architectures/gemma.py does: K/V written first, then a `lax.cond` between two attention calls
  that only read the cache (under the `unroll` loop each layer's window is static);
- q/k/v and o projections carry biases; RoPE is YaRN-scaled (model/config.py);
- the router has a bias and takes the softmax of its top-k logits; the experts have biases and
  gpt-oss's clamped SwiGLU (`moe.ExpertAct`).

Checkpoints: HF stores each layer's experts stacked and transposed ([E, in, out], gate and up
interleaved column by column), in bf16 or as MXFP4 (`*_blocks` of packed FP4 e2m1 pairs and
`*_scales` of E8M0 exponents, one per 32 values of an input row); both are brought to MoELM's
[E, out, in] gate|up layout at load. Where the kernels keep GGML blocks (weights.WeightFormats) MXFP4
stays MXFP4, rearranged into GGML's blocks (ggml_blocks.mxfp4_from_hf: the same values), else it is
dequantised (`dequantize_mxfp4`). A GGUF (llama.cpp's `gpt-oss` architecture) holds them split into
gate and up, [E, out, in], MXFP4 as GGML blocks, kept as they are or dequantised alike (`_split_experts`). Replies are in
OpenAI's harmony format, which runtime/replies/harmony.py reads (reasoning, answer and tool calls).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from imp_jax.kernels_pallas import ggml_blocks
from imp_jax.kernels_pallas.attention import paged_attention
from imp_jax.kernels_pallas.kv_cache import write_kv
from imp_jax.model.base import ModelOptions
from imp_jax.model.config import ModelConfig
from imp_jax.model.layers import apply_rope, rms_norm
from imp_jax.model.architectures.llama import layer_linear
from imp_jax.model.architectures.moe import MoELayers, MoELM, shard_putter
from imp_jax.model.tensor_parallel import TensorParallel
from imp_jax.model.formats.weights import WeightSource

# FP4 e2m1 values by their 4-bit code (sign in the high bit)
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 as gpt-oss checkpoints store it -> float32 [..., rows, G * 32].

    blocks uint8 [..., rows, G, 16]: each byte two FP4 codes, the low nibble first; scales uint8
    [..., rows, G]: one E8M0 exponent (bias 127) per group of 32 values."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape}: expected "
                         f"[..., G, 16] and [..., G]")
    values = np.empty(blocks.shape[:-1] + (32,), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(blocks.shape[:-2] + (-1,))


class GptOssLayers(MoELayers):
    """MoELayers plus the o projection's bias and the attention sinks, stacked [L, ...]."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, tp: TensorParallel):
        super().__init__(cfg, dtype, rngs, tp)
        L = cfg.num_layers
        self.o_bias = nnx.Param(jnp.zeros((L, cfg.hidden_size), dtype), axes=("layers", "embed"))
        self.sinks = nnx.Param(jnp.zeros((L, tp.n * tp.local_heads), jnp.float32), axes=("layers", "heads"))


class GptOssLM(MoELM):
    """GptOssForCausalLM over a ragged token batch and a paged KV cache (model/base.py, the contract)."""

    layers_class = GptOssLayers

    def sliding_layers(self) -> np.ndarray:
        """bool [L]: which layers attend through the sliding window."""
        c = self.config
        return np.array([c.layer_window(i) is not None for i in range(c.num_layers)])

    def _layer(self, x, w, mats, loras, i, cos, sin, k_cache, v_cache, meta):
        """One gpt-oss layer; `i` a Python int (unrolled: the window is static) or traced (scan)."""
        cfg, kernels = self.config, self.options.kernels
        T, D = x.shape[0], cfg.head_dim
        heads, kv_heads = self.tp.local_heads, self.tp.local_kv_heads
        h = rms_norm(x, w["input_norm"], cfg.rms_norm_eps)
        qkv = layer_linear(h, mats["qkv_proj"], i, w.get("qkv_bias"), kernels)
        q, k, v = jnp.split(qkv, [heads * D, (heads + kv_heads) * D], axis=-1)
        q, k, v = q.reshape(T, heads, D), k.reshape(T, kv_heads, D), v.reshape(T, kv_heads, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = write_kv(k_cache, v_cache, k, v, meta.slot_mapping, i)

        def attend(window):
            return lambda q, kc, vc: paged_attention(q, kc, vc, meta, i, sm_scale=D ** -0.5, sliding_window=window,
                                                     kernels=kernels, sinks=w["sinks"])
        sliding = self.sliding_layers()
        if isinstance(i, int) or len(set(sliding.tolist())) == 1:
            window = cfg.sliding_window if sliding[i if isinstance(i, int) else 0] else None
            attn = attend(window)(q, k_cache, v_cache)
        else:
            attn = jax.lax.cond(jnp.asarray(sliding)[i], attend(cfg.sliding_window), attend(None),
                                q, k_cache, v_cache)
        o = layer_linear(attn.astype(x.dtype).reshape(T, heads * D), mats["o_proj"], i, self._once(w["o_bias"]),
                         kernels)
        x = x + self._reduce(o)
        h = rms_norm(x, w["post_norm"], cfg.rms_norm_eps)
        x = x + self._mlp(h, mats, loras, i, meta)
        return x, k_cache, v_cache

    @classmethod
    def from_hf_tensors(cls, config: ModelConfig, weights: WeightSource,
                        options: ModelOptions = ModelOptions()) -> "GptOssLM":
        """Build from a GptOssForCausalLM checkpoint's tensors: MoELM's attention and norms, then the
        o projection's bias, the sinks and the experts (`_load_experts`)."""
        model = super().from_hf_tensors(config, weights, options)
        ly, L = model.layers, config.num_layers
        o_bias = np.stack([weights.tensor(f"model.layers.{i}.self_attn.o_proj.bias") for i in range(L)])
        sinks = np.stack([weights.tensor(f"model.layers.{i}.self_attn.sinks") for i in range(L)])
        shard_putter(model.tp, options.dtype)(ly.o_bias, o_bias)
        shard_putter(model.tp, jnp.float32)(ly.sinks, sinks, model.tp.head_index(config), 1)   # per query head
        return model

    @classmethod
    def _load_experts(cls, model: "GptOssLM", config: ModelConfig, weights: WeightSource,
                      options: ModelOptions) -> None:
        """Router weight and bias; experts from `mlp.experts.{gate_up,down}_proj` ([E, in, out],
        bf16 / float) or their MXFP4 `_blocks` / `_scales` ([E, out, in] once dequantised), gate and
        up de-interleaved into MoELM's [gate | up] halves, with their biases."""
        put = shard_putter(model.tp, options.dtype)
        gate_up, down = model.tp.fused_index(config.intermediate_size), model.tp.split_index(config.intermediate_size)

        def experts(pre: str, name: str) -> np.ndarray:   # [E, out, in], or GGML MXFP4 blocks [E, out, in / 32, 17]
            if f"{pre}.{name}_blocks" in weights:
                blocks, scales = weights.tensor(f"{pre}.{name}_blocks"), weights.tensor(f"{pre}.{name}_scales")
                if weights.formats.ggml_blocks:   # kept: the same values, GGML's byte order
                    return ggml_blocks.mxfp4_from_hf(blocks, scales)
                return dequantize_mxfp4(blocks, scales)
            return np.swapaxes(np.asarray(weights.tensor(f"{pre}.{name}")), 1, 2)

        def halves(x: np.ndarray) -> np.ndarray:   # interleaved gate, up along axis 1 -> [gate | up]
            return np.concatenate([x[:, 0::2], x[:, 1::2]], axis=1)

        for i, mlp in enumerate(model.layers.mlp):
            pre = f"model.layers.{i}.mlp"
            put(mlp.router, weights.tensor(f"{pre}.router.weight"))
            put(mlp.router_bias, weights.tensor(f"{pre}.router.bias"))
            if f"{pre}.experts.gate_proj.weight" in weights:   # a GGUF's: already split, [E, out, in]
                gu, gu_bias, dn, dn_bias = cls._split_experts(f"{pre}.experts", weights)
            else:
                gu = halves(experts(f"{pre}.experts", "gate_up_proj"))
                gu_bias = halves(weights.tensor(f"{pre}.experts.gate_up_proj_bias"))
                dn = experts(f"{pre}.experts", "down_proj")
                dn_bias = weights.tensor(f"{pre}.experts.down_proj_bias")
            put(mlp.gate_up, gu, gate_up, 1)
            put(mlp.gate_up_bias, gu_bias, gate_up, 1)   # split with its rows
            put(mlp.down, dn, down, 2)
            put(mlp.down_bias, dn_bias)                  # whole on every shard, added by shard 0 (MoELM._sparse)

    @staticmethod
    def _split_experts(pre: str, weights: WeightSource) -> tuple[np.ndarray, ...]:
        """Experts as a gpt-oss GGUF holds them (model/formats/gguf_loader.py): llama.cpp's converter has
        de-interleaved gate and up into `gate_proj` / `up_proj` ([E, out, in], MXFP4 or float, read
        dequantised) with [E, out] biases, so they only need joining into MoELM's [gate | up].
        Returns gate|up, its bias, down, its bias."""
        bias = np.concatenate([weights.tensor(f"{pre}.gate_proj.bias"), weights.tensor(f"{pre}.up_proj.bias")], axis=1)
        return (weights.stack(f"{pre}.gate_proj.weight", f"{pre}.up_proj.weight"), bias,
                weights.stack(f"{pre}.down_proj.weight"), weights.tensor(f"{pre}.down_proj.bias"))
