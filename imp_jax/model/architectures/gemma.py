"""Gemma 2 and Gemma 3 (text): the decoder of model/architectures/llama.py with Gemma's numerics.

What differs from DecoderLM:
- RMSNorm scales by (1 + weight); the weights are kept as the checkpoint has them (HF's, and a
  GGUF's less the 1 llama.cpp added) and the 1 is added in float32 where they are used, as HF does;
- the embedding is multiplied by sqrt(hidden_size) rounded to the model dtype;
- attention is scaled by `query_pre_attn_scalar ** -0.5`, its scores soft-capped (Gemma 2), and its
  output normed before the residual add; the MLP is gelu(tanh)-gated between two more norms;
- the final logits are soft-capped (Gemma 2);
- layers alternate sliding-window and global attention (`config.layer_types`); Gemma 3 norms q and
  k per head and rotates the sliding layers with their own RoPE base (`rope_local_theta`).

A layer's window is static to the attention kernels. Under the `scan` layer loop a layer picks its
kind with `lax.cond` on a per-layer flag: K/V are written to the cache first, outside the cond, so
the branches only read the cache (no copy of it), and only the chosen branch runs. Under `unroll`
each layer's window is known when tracing. Every layer keeps a full-length paged KV cache: sliding
layers only mask what they read (their blocks beyond the window are not reclaimed).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from imp_jax.errors import ModelLoadError
from imp_jax.kernels_pallas import AttentionMetadata, paged_attention
from imp_jax.kernels_pallas.kv_cache import write_kv
from imp_jax.model.base import KVCache, ModelOptions
from imp_jax.model.config import ModelConfig, RopeScaling, opt_float, parse_rope_scaling
from imp_jax.model.family import Family, GGUFNames, TextConfig
from imp_jax.model.formats.gguf_metadata import Metadata, f32, layer_types, opt_f32
from imp_jax.model.layers import apply_rope, override_rows, rms_norm, rope_tables
from imp_jax.model.architectures.llama import DecoderLayers, DecoderLM
from imp_jax.model.tensor_parallel import TensorParallel
from imp_jax.model.weights import WeightSource, stored

# where a Gemma3ForConditionalGeneration checkpoint keeps its language model's `model.*` and `lm_head.*`
MULTIMODAL_PREFIXES = (("language_model.model.", "language_model.lm_head."),
                       ("model.language_model.", "lm_head."))
NORMS = ("input_norm", "post_norm", "pre_ffn_norm", "post_ffn_norm", "q_norm", "k_norm")


@dataclasses.dataclass(frozen=True)
class GemmaConfig(ModelConfig):
    """ModelConfig plus Gemma 2 / 3's numerics (`FAMILY.parse` reads them)."""

    query_pre_attn_scalar: float | None = None   # attention scale is this ** -0.5 (None: head_dim)
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap) before the softmax
    final_logit_softcapping: float | None = None # logits -> cap * tanh(logits / cap)
    rope_local_theta: float | None = None        # Gemma 3: RoPE base of the sliding layers (no scaling)


class GemmaLayers(DecoderLayers):
    """DecoderLayers plus the feed-forward's pre and post norms; every norm holds HF's weight w
    (the scale is 1 + w), zero-initialised."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, tp: TensorParallel):
        super().__init__(cfg, dtype, rngs, tp)
        L, E = cfg.num_layers, cfg.hidden_size
        self.pre_ffn_norm = nnx.Param(jnp.zeros((L, E), dtype), axes=("layers", "embed"))
        self.post_ffn_norm = nnx.Param(jnp.zeros((L, E), dtype), axes=("layers", "embed"))
        for name in NORMS:
            p = getattr(self, name)
            if p is not None:
                p.set_value(jnp.zeros_like(p[...]))


def gemma_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm: x normalised in float32, times (1 + w) in float32, back to x's dtype."""
    return rms_norm(x, 1.0 + w.astype(jnp.float32), eps)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else cap * jnp.tanh(x / cap)


class GemmaLM(DecoderLM):
    """Gemma2ForCausalLM / Gemma3ForCausalLM over a ragged token batch and a paged KV cache
    (model/base.py, the contract)."""

    takes_embed_rows = True    # Gemma 3's images (model/vision/gemma3.py) as embedding overrides

    def __init__(self, config: GemmaConfig, options: ModelOptions = ModelOptions(), *, rngs: nnx.Rngs):
        super().__init__(config, options, rngs=rngs)
        self.layers = GemmaLayers(config, options.dtype, rngs, self.tp)
        self.norm = nnx.Param(jnp.zeros((config.hidden_size,), options.dtype), axes=("embed",))

    def sliding_layers(self) -> np.ndarray:
        """bool [L]: which layers attend through the sliding window."""
        c = self.config
        return np.array([c.layer_window(i) is not None for i in range(c.num_layers)])

    def _rope(self, positions: jax.Array) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
        """(cos, sin) of the global layers and of the sliding ones (Gemma 3's local base, unscaled)."""
        c = self.config
        full = rope_tables(positions, c.rope_inv_freq())
        if c.rope_local_theta is None:
            return full, full
        local = dataclasses.replace(c, rope_theta=c.rope_local_theta, rope_scaling=RopeScaling())
        return full, rope_tables(positions, local.rope_inv_freq())

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv: KVCache,
                 meta: AttentionMetadata, lora_ids: jax.Array | None = None, embed_rows: jax.Array | None = None,
                 embed_slots: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """Hidden states [T, hidden] (before the final norm) and the updated KV cache. `embed_rows` [M, hidden]
        replace the embeddings of token rows `embed_slots` [M] after the sqrt(hidden) scaling, unscaled, as
        transformers scatters Gemma 3's image features (model/base.py; a slot >= T writes nowhere)."""
        cfg = self.config
        vectors = self.layers.vectors()
        proj = self._projections(lora_ids, self.layers.matrices())
        x = proj.embed(self.embed[...], input_ids, self.dtype, scale=cfg.hidden_size ** 0.5)   # PEFT: delta after scale
        ropes = self._rope(positions)
        if embed_rows is not None:
            x = override_rows(x, embed_rows, embed_slots)
        sliding = self.sliding_layers()

        def layer(carry, xs):
            x, k_cache, v_cache = carry
            w, i, is_sliding = xs
            x, k_cache, v_cache = self._layer(x, w, proj, i, is_sliding, ropes, k_cache, v_cache, meta)
            return (x, k_cache, v_cache), None

        carry = (x, *kv)
        if self.options.layer_loop == "scan":
            layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
            carry, _ = jax.lax.scan(layer, carry, (vectors, layer_ids, jnp.asarray(sliding)))
        else:
            for i in range(cfg.num_layers):
                carry, _ = layer(carry, ({k: w[i] for k, w in vectors.items()}, i, bool(sliding[i])))
        x, k_cache, v_cache = carry
        return x, (k_cache, v_cache)

    def _layer(self, x, w, proj, i, is_sliding, ropes, k_cache, v_cache, meta):
        """One Gemma layer; `is_sliding` a Python bool (unrolled) or a traced one (scan)."""
        cfg, kernels = self.config, self.options.kernels
        eps = cfg.rms_norm_eps
        T, D = x.shape[0], cfg.head_dim
        heads, kv_heads = self.tp.local_heads, self.tp.local_kv_heads
        h = gemma_norm(x, w["input_norm"], eps)
        qkv = proj.column("qkv_proj", h, i)
        q, k, v = jnp.split(qkv, [heads * D, (heads + kv_heads) * D], axis=-1)
        q, k, v = q.reshape(T, heads, D), k.reshape(T, kv_heads, D), v.reshape(T, kv_heads, D)
        if cfg.qk_norm:
            q, k = gemma_norm(q, w["q_norm"], eps), gemma_norm(k, w["k_norm"], eps)
        (cos_g, sin_g), (cos_l, sin_l) = ropes
        static = isinstance(is_sliding, bool)
        if static:
            cos, sin = (cos_l, sin_l) if is_sliding else (cos_g, sin_g)
        elif cos_l is cos_g:
            cos, sin = cos_g, sin_g
        else:
            cos, sin = jnp.where(is_sliding, cos_l, cos_g), jnp.where(is_sliding, sin_l, sin_g)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = write_kv(k_cache, v_cache, k, v, meta.slot_mapping, i)
        scale = (cfg.query_pre_attn_scalar or D) ** -0.5

        def attend(window):
            return lambda q, kc, vc: paged_attention(q, kc, vc, meta, i, sm_scale=scale, sliding_window=window,
                                                     soft_cap=cfg.attn_logit_softcapping, kernels=kernels)
        kinds = set(self.sliding_layers().tolist())
        if static or len(kinds) == 1:
            window = cfg.sliding_window if (is_sliding if static else kinds.pop()) else None
            attn = attend(window)(q, k_cache, v_cache)
        else:
            attn = jax.lax.cond(is_sliding, attend(cfg.sliding_window), attend(None), q, k_cache, v_cache)
        attn = attn.astype(x.dtype)
        o = proj.row("o_proj", attn.reshape(T, heads * D), i)
        x = x + gemma_norm(o, w["post_norm"], eps)
        h = gemma_norm(x, w["pre_ffn_norm"], eps)
        gate, up = jnp.split(proj.column("gate_up_proj", h, i), 2, axis=-1)
        m = proj.row("down_proj", jax.nn.gelu(gate, approximate=True) * up, i)
        x = x + gemma_norm(m, w["post_ffn_norm"], eps)
        return x, k_cache, v_cache

    def logits(self, hidden: jax.Array, lora_ids: jax.Array | None = None) -> jax.Array:
        """Final norm, LM head and (Gemma 2) soft-capping on the rows to sample: float32 [R, vocab]."""
        h = gemma_norm(hidden, self.norm[...], self.config.rms_norm_eps)
        head = self.embed if self.lm_head is None else self.lm_head
        return soft_cap(self._projections(lora_ids).head(head[...], h), self.config.final_logit_softcapping)

    @classmethod
    def from_hf_tensors(cls, config: GemmaConfig, weights: WeightSource,
                        options: ModelOptions = ModelOptions()) -> "GemmaLM":
        """Build from HF-named tensors: DecoderLM's names plus the feed-forward norms. A multimodal
        Gemma 3 checkpoint's language model (`language_model.model.*` or `model.language_model.*`)
        is read under the plain names; its image side is model/vision/gemma3.py's."""
        weights = _language_model(weights)
        model = super().from_hf_tensors(config, weights, options)
        on_host = model.tp.n > 1
        for name, hf in (("pre_ffn_norm", "pre_feedforward_layernorm"),
                         ("post_ffn_norm", "post_feedforward_layernorm")):
            value = np.stack([weights.tensor(f"model.layers.{i}.{hf}.weight") for i in range(config.num_layers)])
            param = getattr(model.layers, name)
            if value.shape != tuple(param.shape):
                raise ValueError(f"{hf}: shape {value.shape} where {param.shape} was expected")
            param.set_value(stored(value, options.dtype, on_host=on_host))
        return model


class _Renamed(Mapping[str, np.ndarray]):
    """A WeightSource's tensors under Gemma3ForCausalLM's names: `model.*` read from `model`,
    `lm_head.*` from `head` (the names from_hf_tensors asks for; not iterable)."""

    def __init__(self, weights: WeightSource, model: str, head: str):
        self._weights, self._model, self._head = weights, model, head

    def _stored(self, name: str) -> str:
        if name.startswith("model."):
            return self._model + name[len("model."):]
        return self._head + name[len("lm_head."):] if name.startswith("lm_head.") else name

    def __getitem__(self, name: str) -> np.ndarray:
        return self._weights.tensor(self._stored(name))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._stored(name) in self._weights

    def __iter__(self) -> Iterator[str]:
        raise TypeError("a renamed view is read by name only")

    def __len__(self) -> int:
        raise TypeError("a renamed view is read by name only")


def _language_model(weights: WeightSource) -> WeightSource:
    """`weights` itself, or, for a multimodal Gemma 3 checkpoint, its language model's tensors under
    the names of a Gemma3ForCausalLM."""
    if "model.embed_tokens.weight" in weights:
        return weights
    for model, head in MULTIMODAL_PREFIXES:
        if model + "embed_tokens.weight" in weights:
            return WeightSource(_Renamed(weights, model, head), weights.formats, weights.source)
    return weights   # the first lookup names what is missing


# ------------------------------------------------------------------------------------- the family
def _parse(hf: Mapping[str, Any], fields: dict[str, Any], source: str) -> dict[str, Any]:
    """GemmaConfig fields of a Gemma 2 / 3 config, over the common ones.

    Gemma 2 alternates sliding and global layers (sliding first); Gemma 3 has `sliding_window_pattern`
    - 1 sliding layers, then a global one, and RoPE bases per layer type: `rope_theta` (global,
    with `rope_scaling`) and `rope_local_base_freq` (sliding). transformers 5 writes both as
    `rope_parameters: {"full_attention": {...}, "sliding_attention": {...}}` and `layer_types`."""
    arch, num_layers = fields["architecture"], fields["num_layers"]
    g3 = arch != "Gemma2ForCausalLM"
    if hf.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{source}: use_bidirectional_attention (an embedding Gemma) is not supported "
                             f"by the causal-LM server")
    if hf.get("attention_bias"):
        raise ModelLoadError(f"{source}: attention_bias is not supported for {arch}")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(f"{source}: hidden_activation {act!r} is not supported for {arch} "
                             f"(supported: gelu_pytorch_tanh)")
    types = hf.get("layer_types")
    if types is None:
        pattern = int(hf.get("sliding_window_pattern") or (6 if g3 else 2))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise ModelLoadError(f"{source}: 'layer_types' must be a list of strings")
    window = hf.get("sliding_window", 4096)
    if window is None and "sliding_attention" in types:
        raise ModelLoadError(f"{source}: 'sliding_window' is null but layer_types has sliding layers")
    out: dict[str, Any] = dict(
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or 256),
        attn_logit_softcapping=opt_float(hf.get("attn_logit_softcapping", None if g3 else 50.0)),
        final_logit_softcapping=opt_float(hf.get("final_logit_softcapping", None if g3 else 30.0)),
        layer_types=tuple(types), sliding_window=int(window) if window else None,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)), qk_norm=g3)
    params = hf.get("rope_parameters") or {}
    if isinstance(params.get("full_attention"), dict):   # transformers 5: per layer type
        full, local = params["full_attention"], params.get("sliding_attention") or {}
        out["rope_theta"] = float(full.get("rope_theta", 1e6 if g3 else 10000.0))
        out["rope_scaling"] = parse_rope_scaling(full, source)
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError(f"{source}: scaled RoPE on sliding layers is not supported")
        out["rope_local_theta"] = float(local.get("rope_theta", 10000.0))
    elif g3:
        out["rope_theta"] = float(hf.get("rope_theta") or params.get("rope_theta") or 1e6)
        out["rope_local_theta"] = float(hf.get("rope_local_base_freq") or 10000.0)
    if g3 and "rope_local_theta" not in out:
        out["rope_local_theta"] = 10000.0
    return out


def _gguf_config(arch: str, meta: Metadata, cfg: dict[str, Any], raw: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 2 / 3 keys as llama.cpp reads them: the attention scale is `attention.scale` when
    written, else 1/sqrt(head_dim), or 1/sqrt(hidden / heads) for the 27B models (46 or 62
    layers), which is HF's `query_pre_attn_scalar`; the sliding-window pattern is
    `attention.sliding_window_pattern` (a period, or a per-layer bool array, true = sliding) else
    llama.cpp's fixed 2 (Gemma 2) or 6 (Gemma 3); the sliding layers' RoPE base is
    `rope.freq_base_swa`, else 10000."""
    a = lambda key: f"{arch}.{key}"  # noqa: E731
    layers, g3 = cfg["num_hidden_layers"], arch == "gemma3"
    scale = meta.get(a("attention.scale"))
    if scale:
        scalar = round(1.0 / float(scale) ** 2, 4)   # a float32 scale: 24 comes back as 23.999998
    elif layers == (62 if g3 else 46):
        scalar = cfg["hidden_size"] / cfg["num_attention_heads"]
    else:
        scalar = cfg["head_dim"]
    types = layer_types(meta, arch, layers, 6 if g3 else 2)
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": f32(scalar),
        "attn_logit_softcapping": opt_f32(meta.get(a("attn_logit_softcapping"))),
        "final_logit_softcapping": opt_f32(meta.get(a("final_logit_softcapping"))),
        "sliding_window": meta.get(a("attention.sliding_window"), 4096),
        "layer_types": types,
    }
    if g3:
        out["rope_theta"] = f32(meta.get(a("rope.freq_base"), 1e6))
        out["rope_local_base_freq"] = f32(meta.get(a("rope.freq_base_swa"), 10000.0))
    return out


# Gemma's four norms per layer (llama's `ffn_norm` is Gemma's pre-feed-forward norm), stored as weight + 1
_GGUF_LAYER_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                     "post_ffw_norm": "post_feedforward_layernorm"}
# Gemma3TextConfig's defaults, which a multimodal Gemma 3's `text_config` relies on (it omits them)
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6, max_position_embeddings=131072,
    query_pre_attn_scalar=256, sliding_window=4096, rope_theta=1e6, rope_local_base_freq=1e4,
    bos_token_id=2, eos_token_id=1)
FAMILY = Family(config=GemmaConfig, parse=_parse, gguf=tuple(
    GGUFNames(arch, hf_arch, config=_gguf_config, layer_names=_GGUF_LAYER_NAMES, norm_plus_one=True)
    for arch, hf_arch in (("gemma2", "Gemma2ForCausalLM"), ("gemma3", "Gemma3ForCausalLM"))),
    text_configs={"Gemma3ForConditionalGeneration": TextConfig(GEMMA3_TEXT_DEFAULTS)})
