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

import dataclasses
from typing import Any, ClassVar, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from imp_jax.errors import ModelLoadError
from imp_jax.kernels_pallas import ggml_blocks
from imp_jax.kernels_pallas.attention import paged_attention
from imp_jax.kernels_pallas.kv_cache import write_kv
from imp_jax.model.base import ModelOptions
from imp_jax.model.family import Family, GGUFNames
from imp_jax.model.formats.gguf_metadata import Metadata, f32, layer_types
from imp_jax.model.layers import apply_rope, rms_norm
from imp_jax.model.architectures.moe import MoEConfig, MoELayers, MoELM, moe_fields, shard_putter
from imp_jax.model.tensor_parallel import TensorParallel
from imp_jax.model.weights import WeightSource

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


@dataclasses.dataclass(frozen=True)
class GptOssConfig(MoEConfig):
    """MoEConfig with attention sinks: a learned per-head logit joins each softmax's denominator."""

    attention_sinks: ClassVar[bool] = True


class GptOssLayers(MoELayers):
    """MoELayers plus the o projection's bias and the attention sinks, stacked [L, ...]."""

    def __init__(self, cfg: GptOssConfig, dtype: jnp.dtype, rngs: nnx.Rngs, tp: TensorParallel):
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

    def _layer(self, x, w, proj, i, cos, sin, k_cache, v_cache, meta):
        """One gpt-oss layer; `i` a Python int (unrolled: the window is static) or traced (scan)."""
        cfg, kernels = self.config, self.options.kernels
        T, D = x.shape[0], cfg.head_dim
        heads, kv_heads = self.tp.local_heads, self.tp.local_kv_heads
        h = rms_norm(x, w["input_norm"], cfg.rms_norm_eps)
        qkv = proj.column("qkv_proj", h, i, bias=w.get("qkv_bias"))
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
        x = x + proj.row("o_proj", attn.astype(x.dtype).reshape(T, heads * D), i, bias=w["o_bias"])
        h = rms_norm(x, w["post_norm"], cfg.rms_norm_eps)
        x = x + self._mlp(h, proj, i, meta)
        return x, k_cache, v_cache

    @classmethod
    def from_hf_tensors(cls, config: GptOssConfig, weights: WeightSource,
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
    def _load_experts(cls, model: "GptOssLM", config: GptOssConfig, weights: WeightSource,
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


# ------------------------------------------------------------------------------------- the family
def _parse(hf: Mapping[str, Any], fields: dict[str, Any], source: str) -> dict[str, Any]:
    """GptOssConfig fields of a gpt-oss config: the experts, alternating sliding / full layers (sliding first
    unless `layer_types` says otherwise), the router's softmax over the top-k logits, biased experts and the
    clamped SwiGLU."""
    num_layers = fields["num_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                      for i in range(num_layers)]
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise ModelLoadError(f"{source}: 'layer_types' must be a list of strings")
    window = hf.get("sliding_window", 128)
    if not window and "sliding_attention" in types:
        raise ModelLoadError(f"{source}: 'sliding_window' is null but layer_types has sliding layers")
    try:
        alpha, limit = float(hf.get("swiglu_alpha", 1.702)), float(hf.get("swiglu_limit", 7.0))
    except (TypeError, ValueError):
        raise ModelLoadError(f"{source}: 'swiglu_alpha' and 'swiglu_limit' must be numbers") from None
    return {**moe_fields(hf, fields["architecture"], source),
            **dict(layer_types=tuple(types), sliding_window=int(window) if window else None,
                   attention_bias=bool(hf.get("attention_bias", True)), router="topk_softmax", norm_topk_prob=False,
                   expert_bias=True, expert_act="swiglu_clamped", swiglu_alpha=alpha, swiglu_limit=limit)}


# llama.cpp's default gpt-oss values: every other layer slides (the first does), YaRN's betas; the
# clamped SwiGLU's alpha and limit are fixed there (GptOssConfig's defaults, which `_parse` applies)
_SWA_PERIOD = 2
_YARN_BETAS = (32.0, 1.0)


def _gguf_config(arch: str, meta: Metadata, cfg: dict[str, Any], raw: Mapping[str, Any]) -> dict[str, Any]:
    """gpt-oss keys as llama.cpp's converter writes them (conversion/gpt_oss.py) and its loader reads
    them (src/models/openai-moe.cpp): the experts' width is `expert_feed_forward_length` (HF's
    `intermediate_size`; `feed_forward_length` holds the same), the window `attention.sliding_window`
    (required), the sliding layers `attention.sliding_window_pattern` (never written: llama.cpp's
    default period 2, the first layer sliding), YaRN as `rope.scaling.*` (betas from
    `rope.scaling.yarn_beta_fast/slow`, else llama.cpp's 32 and 1). HF's gpt-oss YaRN does not
    round the ramp's ends (`truncate: false`); llama.cpp does, which moves a few frequencies
    slightly: we follow HF, so a GGUF and the checkpoint it came from load to the same model.
    A `rope.freq_base_swa` other than `rope.freq_base` (llama.cpp reads one; HF's gpt-oss has no such
    field) is refused."""
    a = lambda key: f"gpt-oss.{key}"  # noqa: E731
    layers = cfg["num_hidden_layers"]
    window = meta.get(a("attention.sliding_window"))
    if not window:
        raise ModelLoadError(f"{meta.path}: GGUF metadata lacks '{a('attention.sliding_window')}'")
    swa_base = meta.get(a("rope.freq_base_swa"))
    if swa_base is not None and f32(swa_base) != cfg["rope_theta"]:
        raise ModelLoadError(f"{meta.path}: {a('rope.freq_base_swa')} = {f32(swa_base)} differs from "
                             f"{a('rope.freq_base')} = {cfg['rope_theta']}; gpt-oss has one RoPE base")
    expert_width = meta.get(a("expert_feed_forward_length"))
    if isinstance(expert_width, list):   # llama.cpp accepts one per layer; gpt-oss has one width
        if len(set(expert_width)) != 1:
            raise ModelLoadError(f"{meta.path}: per-layer {a('expert_feed_forward_length')} is not supported")
        expert_width = expert_width[0]
    out: dict[str, Any] = {
        "intermediate_size": int(expert_width or cfg["intermediate_size"]),
        "num_local_experts": int(meta.need(a("expert_count"))),
        "num_experts_per_tok": int(meta.need(a("expert_used_count"))),
        "sliding_window": int(window),
        "layer_types": layer_types(meta, "gpt-oss", layers, _SWA_PERIOD),
    }
    rope = cfg["rope_scaling"]
    if rope is not None:
        if rope["rope_type"] != "yarn":
            raise ModelLoadError(f"{meta.path}: gpt-oss rope scaling '{rope['rope_type']}' is not supported "
                                 f"(llama.cpp writes yarn)")
        fast = meta.get(a("rope.scaling.yarn_beta_fast")) or _YARN_BETAS[0]
        slow = meta.get(a("rope.scaling.yarn_beta_slow")) or _YARN_BETAS[1]
        out["rope_scaling"] = {**rope, "beta_fast": f32(fast), "beta_slow": f32(slow), "truncate": False}
    return out


# its own norm, sink and router names; llama.cpp's converter splits HF's interleaved gate_up into stacked
# [E, out, in] gate and up tensors (biases [E, out] likewise), which keep HF's Qwen-MoE-style names here and
# GptOssLM reads as they are
FAMILY = Family(config=GptOssConfig, parse=_parse, gguf=(GGUFNames(
    "gpt-oss", "GptOssForCausalLM", experts=True, config=_gguf_config, bare=("attn_sinks",), split_qkv=True,
    layer_names={"attn_qkv": "self_attn.qkv_proj",   # --fuse-qkv: read as HF's q, k and v (split_qkv)
                 "post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks",
                 "ffn_gate_inp": "mlp.router", "ffn_gate_exps": "mlp.experts.gate_proj",
                 "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj"}),))
