"""The decoder family: Llama 2/3.x, SmolLM2, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm).

Projections are fused (q|k|v and gate|up) so each is one GEMM, and kept in HF's [out, in]
layout, which XLA's CPU GEMMs run faster than [in, out] at decode sizes (docs/PERF.md).
Each layer's matrices are their own arrays: under the `scan` layer loop a projection picks
its layer's matrix with `lax.switch`, so the GEMM reads the weight in place, where slicing a
stacked [L, ...] array copied every layer's weights on every step (docs/PERF.md). Norm scales
and biases are small and stay stacked along a leading layer axis.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from imp_jax.kernels_pallas import AttentionMetadata, ggml_blocks, ragged_paged_attention
from imp_jax.model.base import KVCache, ModelOptions
from imp_jax.model.config import ModelConfig, attention_bias
from imp_jax.model.family import Family, GGUFNames, TextConfig
from imp_jax.model.formats.gguf_metadata import Metadata
from imp_jax.model.layers import apply_rope, mrope_tables, override_rows, rms_norm, rope_tables
from imp_jax.model.lora import LoraOptions, LoraSlabs, LoraTarget, slab_dtype
from imp_jax.model.projections import Projections
from imp_jax.model.tensor_parallel import TensorParallel, take_columns, take_rows
from imp_jax.model.weights import Matrix, WeightSource, stored

MATRICES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class DecoderLayers(nnx.Module):
    """All layers' weights: matrices as one [out, in] Matrix per layer, vectors stacked [L, ...].

    Fused axes: `qkv` is [q heads | k heads | v heads] x head_dim, `gate_up` is [gate | up]; on N
    tensor-parallel shards each is that order per shard, shard after shard (model/tensor_parallel.py).
    """

    MATRICES = MATRICES   # the per-layer projections `matrices` hands the layer loop

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, tp: TensorParallel):
        L, E, D = cfg.num_layers, cfg.hidden_size, cfg.head_dim
        I = tp.n * tp.local_mlp                                   # the intermediate size, padded to N shards
        qkv = tp.n * (tp.local_heads + 2 * tp.local_kv_heads) * D
        q_size = tp.n * tp.local_heads * D
        init = nnx.initializers.normal(0.02)
        key = rngs.params

        def per_layer(shape: tuple[int, int], axes: tuple[str, str]) -> nnx.List:
            return nnx.List([Matrix(init(key(), shape, dtype), axes=axes) for _ in range(L)])

        def stacked(value: jax.Array, axis: str) -> nnx.Param:
            return nnx.Param(value, axes=("layers", axis))

        self.input_norm = stacked(jnp.ones((L, E), dtype), "embed")
        self.qkv_proj = per_layer((qkv, E), ("qkv", "embed"))
        self.qkv_bias = stacked(jnp.zeros((L, qkv), dtype), "qkv") if cfg.attention_bias else None
        self.q_norm = stacked(jnp.ones((L, D), dtype), "head_dim") if cfg.qk_norm else None
        self.k_norm = stacked(jnp.ones((L, D), dtype), "head_dim") if cfg.qk_norm else None
        self.o_proj = per_layer((E, q_size), ("embed", "heads"))
        self.post_norm = stacked(jnp.ones((L, E), dtype), "embed")
        if "gate_up_proj" in self.MATRICES:   # a subclass may hold its MLPs otherwise (model/architectures/moe.py)
            self.gate_up_proj = per_layer((2 * I, E), ("gate_up", "embed"))
            self.down_proj = per_layer((E, I), ("embed", "mlp"))

    def vectors(self) -> dict[str, jax.Array]:
        """The stacked [L, ...] norm scales and biases (absent optional ones left out)."""
        return {name: p[...] for name, p in vars(self).items() if isinstance(p, nnx.Param)}

    def matrices(self) -> dict[str, tuple[jax.Array, ...]]:
        """Each projection's per-layer [out, in] matrices."""
        return {name: tuple(p[...] for p in getattr(self, name)) for name in self.MATRICES}


class DecoderLM(nnx.Module):
    """A causal LM over a flat ragged token batch with a paged KV cache (model/base.py, the contract)."""

    layers_class = DecoderLayers   # a subclass may swap the MLPs (model/architectures/moe.py: `_mlp`, `_load_mlp`)
    takes_embed_rows = True        # the forward takes `embed_rows`/`embed_slots` (model/base.py)

    def __init__(self, config: ModelConfig, options: ModelOptions = ModelOptions(), *, rngs: nnx.Rngs):
        self.config = config
        self.options = options
        self.tp = TensorParallel.of(config, options.tensor_parallel)
        dtype = options.dtype
        init = nnx.initializers.normal(0.02)
        vocab = "vocab" if self.tp.n == 1 or self.tp.vocab_parallel else None   # None: replicated
        self.logits_axes = (None, vocab)   # the sharding of `logits`' output on the mesh
        self.embed = Matrix(init(rngs.params(), (config.vocab_size, config.hidden_size), dtype),
                            axes=(vocab, "embed"))
        self.layers = self.layers_class(config, dtype, rngs, self.tp)
        self.norm = nnx.Param(jnp.ones((config.hidden_size,), dtype), axes=("embed",))
        self.lm_head = (None if config.tie_word_embeddings else
                        Matrix(init(rngs.params(), (config.vocab_size, config.hidden_size), dtype),
                               axes=(vocab, "embed")))
        self.lora: LoraSlabs | None = nnx.data(None)   # enable_lora

    def lora_targets(self) -> dict[str, LoraTarget]:
        """The PEFT target modules an adapter may hold, by name, and where each lives."""
        c = self.config
        E, I, q, kv = c.hidden_size, c.intermediate_size, c.q_size, c.kv_size
        return {"q_proj": LoraTarget("qkv_proj", 0, E, q), "k_proj": LoraTarget("qkv_proj", 1, E, kv),
                "v_proj": LoraTarget("qkv_proj", 2, E, kv), "o_proj": LoraTarget("o_proj", 0, q, E),
                "gate_proj": LoraTarget("gate_up_proj", 0, E, I), "up_proj": LoraTarget("gate_up_proj", 1, E, I),
                "down_proj": LoraTarget("down_proj", 0, I, E),
                "lm_head": LoraTarget("lm_head", 0, E, c.vocab_size),             # also when tied to the embedding
                "embed_tokens": LoraTarget("embed_tokens", 0, c.vocab_size, E)}   # A [r, vocab], B [hidden, r]

    def enable_lora(self, options: LoraOptions) -> None:
        """Give every projection zeroed adapter slabs (model/lora.py); the forward then takes `lora_ids`."""
        projections: dict[str, tuple[int, list[int]]] = {}
        for t in sorted(self.lora_targets().values(), key=lambda t: (t.fused, t.part)):
            in_dim, outs = projections.setdefault(t.fused, (t.in_dim, []))
            outs.append(t.out_dim)
        self.lora = LoraSlabs({k: (i, tuple(o)) for k, (i, o) in projections.items()},
                              self.config.num_layers, options, slab_dtype(self.options.kernels, self.dtype))

    @property
    def dtype(self) -> jnp.dtype:
        return self.options.dtype

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of K (and of V): [num_layers, num_blocks, block_size, num_kv_heads, head_dim]; on N
        shards the kv-head axis holds every shard's heads (N times them all when they are replicated)."""
        c = self.config
        return (c.num_layers, num_blocks, block_size, self.tp.n * self.tp.local_kv_heads, c.head_dim)

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv: KVCache,
                 meta: AttentionMetadata, lora_ids: jax.Array | None = None,
                 residuals: bool = False, embed_rows: jax.Array | None = None,
                 embed_slots: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """Hidden states [T, hidden] (before the final norm) and the updated KV cache. `lora_ids`
        [T] (with `enable_lora`): each token's adapter slot, 0 = none. `residuals` (logit_lens,
        runtime/decoding/logit_lens.py): also return the residual after every layer, stacked [L, T, hidden].
        `embed_rows` [M, hidden] replace the embeddings of token rows `embed_slots` [M] (images; a
        slot >= T is padding and writes nowhere). `positions` may be [3, T] when the config has
        `mrope_section` (Qwen2.5-VL: temporal, height, width per token); [T] means all three equal."""
        cfg = self.config
        vectors = self.layers.vectors()
        proj = self._projections(lora_ids, self.layers.matrices())
        x = proj.embed(self.embed[...], input_ids, self.dtype)
        if embed_rows is not None:   # after the embedding's LoRA delta: an image row replaces it all
            x = override_rows(x, embed_rows, embed_slots)
        if positions.ndim == 2:
            cos, sin = mrope_tables(positions, cfg.rope_inv_freq(), cfg.mrope_section, cfg.rope_attention_scale)
        else:
            cos, sin = rope_tables(positions, cfg.rope_inv_freq(), cfg.rope_attention_scale)

        def layer(carry, xs):
            x, k_cache, v_cache = carry
            w, i = xs
            x, k_cache, v_cache = self._layer(x, w, proj, i, cos, sin, k_cache, v_cache, meta)
            return (x, k_cache, v_cache), (x if residuals else None)

        carry = (x, *kv)
        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        if self.options.layer_loop == "scan":
            carry, stack = jax.lax.scan(layer, carry, (vectors, layer_ids))
        else:
            outs = []
            for i in range(cfg.num_layers):
                carry, out = layer(carry, ({k: w[i] for k, w in vectors.items()}, i))
                outs.append(out)
            stack = jnp.stack(outs) if residuals else None
        x, k_cache, v_cache = carry
        if residuals:
            return x, (k_cache, v_cache), stack
        return x, (k_cache, v_cache)

    def _projections(self, lora_ids: jax.Array | None,
                     matrices: dict[str, tuple[jax.Array, ...]] | None = None) -> Projections:
        """This step's projections: tensor-parallel, with the adapters of rows `lora_ids` (model/projections.py)."""
        return Projections(self.tp, self.options.kernels, matrices, self.lora, lora_ids)

    def _layer(self, x, w, proj, i, cos, sin, k_cache, v_cache, meta):
        """One decoder layer; `w` holds layer i's vectors, `proj` every layer's projections."""
        cfg, kernels = self.config, self.options.kernels
        T, D = x.shape[0], cfg.head_dim
        heads, kv_heads = self.tp.local_heads, self.tp.local_kv_heads   # this shard's (all on one device)
        h = rms_norm(x, w["input_norm"], cfg.rms_norm_eps)
        qkv = proj.column("qkv_proj", h, i, bias=w.get("qkv_bias"))
        q, k, v = jnp.split(qkv, [heads * D, (heads + kv_heads) * D], axis=-1)
        q = q.reshape(T, heads, D)
        k = k.reshape(T, kv_heads, D)
        v = v.reshape(T, kv_heads, D)
        if cfg.qk_norm:
            q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, w["k_norm"], cfg.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        attn, k_cache, v_cache = ragged_paged_attention(
            q, k, v, k_cache, v_cache, meta, i, sm_scale=cfg.head_dim ** -0.5,
            sliding_window=cfg.sliding_window, kernels=kernels)
        x = x + proj.row("o_proj", attn.reshape(T, heads * D), i)
        h = rms_norm(x, w["post_norm"], cfg.rms_norm_eps)
        x = x + self._mlp(h, proj, i, meta)
        return x, k_cache, v_cache

    def _mlp(self, h, proj, i, meta):
        """Layer i's feed-forward block on the normed hidden states `h` (its residual added by the caller)."""
        gate, up = jnp.split(proj.column("gate_up_proj", h, i), 2, axis=-1)
        return proj.row("down_proj", jax.nn.silu(gate) * up, i)

    def logits(self, hidden: jax.Array, lora_ids: jax.Array | None = None) -> jax.Array:
        """Final norm + LM head on the rows to sample: float32 [R, vocab] (a vocab-parallel shard's
        slice of it, which the mesh gathers: `logits_axes`). `lora_ids` [R] (with
        `enable_lora`): each row's adapter slot, for adapters on the LM head."""
        h = rms_norm(hidden, self.norm[...], self.config.rms_norm_eps)
        head = self.embed if self.lm_head is None else self.lm_head   # both [vocab, hidden]
        return self._projections(lora_ids).head(head[...], h)

    @classmethod
    def from_hf_tensors(cls, config: ModelConfig, weights: WeightSource,
                        options: ModelOptions = ModelOptions()) -> "DecoderLM":
        """Build from HF-named tensors (linears in [out, in]) without a random init; each Matrix is
        stored as `weights.matrix` hands it (the loader's choice, model/weights.py)."""
        model = nnx.eval_shape(lambda: cls(config, options, rngs=nnx.Rngs(0)))
        tp = model.tp
        # on N shards the weights stay host arrays, in shard-major order, and the engine puts each
        # shard straight on its device (no whole copy on one device)
        on_host = tp.n > 1
        shard = {"qkv_proj": lambda w: take_rows(w, tp.qkv_index(config)),
                 "o_proj": lambda w: take_columns(w, tp.o_index(config), tp.n),
                 "gate_up_proj": lambda w: take_rows(w, tp.gate_up_index(config)),
                 "down_proj": lambda w: take_columns(w, tp.down_index(config), tp.n)} if on_host else {}

        def put(param: nnx.Param, value: np.ndarray) -> None:
            shape = ggml_blocks.matrix_shape(value) if ggml_blocks.format_of(value) else tuple(value.shape)
            if shape != tuple(param.shape):
                raise ValueError(f"shape {value.shape} where {param.shape} was expected")
            param.set_value(stored(value, options.dtype, on_host=on_host))

        pre = "model.layers.{}."
        def stacked(*names: str) -> np.ndarray:
            """Every layer's tensors, each layer's concatenated along the first axis, stacked."""
            return np.stack([np.concatenate([weights.tensor(pre.format(i) + n) for n in names])
                             for i in range(config.num_layers)])

        def per_layer(name: str, *names: str) -> None:
            layout = shard.get(name, lambda w: w)
            for i, param in enumerate(getattr(model.layers, name)):
                put(param, layout(weights.matrix(*(pre.format(i) + n for n in names))))

        ly = model.layers
        put(model.embed, weights.matrix("model.embed_tokens.weight"))
        put(model.norm, weights.tensor("model.norm.weight"))
        if model.lm_head is not None:
            put(model.lm_head, weights.matrix("lm_head.weight"))
        put(ly.input_norm, stacked("input_layernorm.weight"))
        put(ly.post_norm, stacked("post_attention_layernorm.weight"))
        per_layer("qkv_proj", *(f"self_attn.{p}_proj.weight" for p in "qkv"))
        per_layer("o_proj", "self_attn.o_proj.weight")
        if "gate_up_proj" in ly.MATRICES:
            per_layer("gate_up_proj", "mlp.gate_proj.weight", "mlp.up_proj.weight")
            per_layer("down_proj", "mlp.down_proj.weight")
        if ly.qkv_bias is not None:
            bias = stacked(*(f"self_attn.{p}_proj.bias" for p in "qkv"))
            put(ly.qkv_bias, take_columns(bias, tp.qkv_index(config)) if on_host else bias)
        if ly.q_norm is not None:
            put(ly.q_norm, stacked("self_attn.q_norm.weight"))
            put(ly.k_norm, stacked("self_attn.k_norm.weight"))
        return model


# ------------------------------------------------------------------------------------- the family
def _parse(hf: Mapping[str, Any], fields: dict[str, Any], source: str) -> dict[str, Any]:
    """What the common fields say otherwise for this family's architectures: Qwen2's (and Qwen2.5-VL's) q/k/v
    carry biases unless the config says otherwise; Qwen3 norms q and k."""
    arch = fields["architecture"]
    if arch in ("Qwen2ForCausalLM", "Qwen2_5_VLForConditionalGeneration"):
        return {"attention_bias": attention_bias(hf, default=True)}
    return {"qk_norm": arch == "Qwen3ForCausalLM"}


def _qwen2_gguf(arch: str, meta: Metadata, cfg: dict[str, Any], raw: Mapping[str, Any]) -> dict[str, Any]:
    """A Qwen2 config's unused window stays unused."""
    return {"use_sliding_window": False}


def _qwen2vl_gguf(arch: str, meta: Metadata, cfg: dict[str, Any], raw: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen2-VL / Qwen2.5-VL's text model: the text fields of its config.json, flat as the hub has them, with
    M-RoPE's `rope.dimension_sections`; its image side comes from a --mmproj file (model/vision/mmproj.py)."""
    sections = list(meta.need(f"{arch}.rope.dimension_sections"))
    return {"use_sliding_window": False, "model_type": "qwen2_5_vl",
            "rope_scaling": {"type": "mrope", "mrope_section": sections[:3]}}


# the image-text checkpoints served by this decoder (images: model/vision/): their text config's class defaults
# (Idefics3Config builds its Llama text config with rms_norm_eps 1e-5; Qwen2_5_VLTextConfig's too)
_IDEFICS3_TEXT = TextConfig({"rms_norm_eps": 1e-5}, ("llama",))
FAMILY = Family(config=ModelConfig, parse=_parse, gguf=(
    GGUFNames("llama", "LlamaForCausalLM", permuted_qk=True),
    GGUFNames("qwen2", "Qwen2ForCausalLM", config=_qwen2_gguf),
    GGUFNames("qwen3", "Qwen3ForCausalLM"),
    GGUFNames("qwen2vl", "Qwen2_5_VLForConditionalGeneration", config=_qwen2vl_gguf)),
    text_configs={"Idefics3ForConditionalGeneration": _IDEFICS3_TEXT,
                  "SmolVLMForConditionalGeneration": _IDEFICS3_TEXT,
                  "Qwen2_5_VLForConditionalGeneration": TextConfig({"rms_norm_eps": 1e-5},
                                                                   ("qwen2_5_vl_text", "qwen2_5_vl"))})
