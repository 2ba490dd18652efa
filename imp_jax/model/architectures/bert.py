"""The encoder family: BERT (MiniLM), RoBERTa and XLM-R, as embedding models or 1-label cross-encoders.

One class for all: RoBERTa and XLM-R differ from BERT only in where positions start (after the
padding id, `position_offset`) and in the names of their tensors. The forward pass takes a padded
batch [B, S] with each row's length (no KV cache: an encoder sees its whole input at once) and
returns either the pooled embedding [B, hidden] (`pool`, before any normalisation) or the
classification logits [B, num_labels] of a `*ForSequenceClassification` head.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from imp_jax.errors import ModelLoadError
from imp_jax.model.layers import layer_norm, linear
from imp_jax.model.weights import WeightSource

EMBEDDING_ARCHITECTURES = ("BertModel", "RobertaModel", "XLMRobertaModel")
CLASSIFIER_ARCHITECTURES = ("BertForSequenceClassification", "RobertaForSequenceClassification",
                            "XLMRobertaForSequenceClassification")
ENCODER_ARCHITECTURES = EMBEDDING_ARCHITECTURES + CLASSIFIER_ARCHITECTURES
POOLINGS = ("mean", "cls", "last", "max")
# llama.cpp's `bert` GGUF names (gguf-py's) -> HF's: the model-wide tensors, and blk.N.<leaf> -> encoder.layer.N.<name>
# (model/formats/gguf_encoder.py reads them)
GGUF_TOP_NAMES = {"token_embd": "embeddings.word_embeddings", "position_embd": "embeddings.position_embeddings",
                  "token_types": "embeddings.token_type_embeddings", "token_embd_norm": "embeddings.LayerNorm"}
GGUF_LAYER_NAMES = {"attn_q": "attention.self.query", "attn_k": "attention.self.key", "attn_v": "attention.self.value",
                    "attn_output": "attention.output.dense", "attn_output_norm": "attention.output.LayerNorm",
                    "ffn_up": "intermediate.dense", "ffn_down": "output.dense", "layer_output_norm": "output.LayerNorm"}


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """Shape and numerics of a BERT-family encoder, from HF config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    position_offset: int = 0   # RoBERTa / XLM-R: positions start at pad_token_id + 1
    num_labels: int = 0        # > 0: a sequence-classification head (cross-encoder)

    @property
    def family(self) -> str:
        return "roberta" if self.architecture.startswith(("Roberta", "XLMRoberta")) else "bert"

    @property
    def max_len(self) -> int:
        """Tokens one input may have: the position table less the RoBERTa offset."""
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> "EncoderConfig":
        archs = hf.get("architectures") if isinstance(hf, dict) else None
        arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
        if arch is None:   # a bare BERT checkpoint may name only its model_type
            arch = {"bert": "BertModel", "roberta": "RobertaModel", "xlm-roberta": "XLMRobertaModel"}.get(
                hf.get("model_type") if isinstance(hf, dict) else None)
        if arch not in ENCODER_ARCHITECTURES:
            raise ModelLoadError(f"{source}: architecture {arch!r} is not an encoder this server runs "
                                 f"(supported: {', '.join(ENCODER_ARCHITECTURES)})", code="unknown_architecture")
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise ModelLoadError(f"{source}: position_embedding_type {hf['position_embedding_type']!r} is not "
                                 "supported (only 'absolute')")
        act = hf.get("hidden_act", "gelu")
        if act != "gelu":
            raise ModelLoadError(f"{source}: hidden_act {act!r} is not supported (only 'gelu')")
        try:
            pad = int(hf.get("pad_token_id") or 0)
            num_labels = 0
            if arch in CLASSIFIER_ARCHITECTURES:
                num_labels = int(hf.get("num_labels") or len(hf.get("id2label") or {}) or 2)
            config = cls(arch, int(hf["vocab_size"]), int(hf["hidden_size"]), int(hf["intermediate_size"]),
                         int(hf["num_hidden_layers"]), int(hf["num_attention_heads"]),
                         int(hf.get("max_position_embeddings", 512)), int(hf.get("type_vocab_size", 2)),
                         float(hf.get("layer_norm_eps", 1e-12)), pad, 0, num_labels)
        except KeyError as e:
            raise ModelLoadError(f"{source}: missing {e}") from None
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"{source}: bad value ({e})") from None
        if config.family == "roberta":
            config = dataclasses.replace(config, position_offset=pad + 1)
        return config


class EncoderLayer(nnx.Module):
    """One post-LayerNorm transformer layer; q|k|v fused into one [3E, E] projection."""

    def __init__(self, cfg: EncoderConfig, dtype: Any):
        E, I = cfg.hidden_size, cfg.intermediate_size
        z = lambda *shape: nnx.Param(jnp.zeros(shape, dtype))
        self.qkv_w, self.qkv_b = z(3 * E, E), z(3 * E)
        self.o_w, self.o_b = z(E, E), z(E)
        self.attn_ln_w, self.attn_ln_b = z(E), z(E)
        self.up_w, self.up_b = z(I, E), z(I)
        self.down_w, self.down_b = z(E, I), z(E)
        self.out_ln_w, self.out_ln_b = z(E), z(E)

    def __call__(self, x: jax.Array, bias: jax.Array, cfg: EncoderConfig) -> jax.Array:
        B, S, E = x.shape
        H = cfg.num_heads
        D = E // H
        qkv = linear(x, self.qkv_w[...], self.qkv_b[...]).reshape(B, S, 3, H, D)
        # jax's fused attention: on XLA:CPU ~3x faster than einsum + softmax + einsum at (32 x 64)
        ctx = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], bias=bias.astype(x.dtype),
                                           scale=D ** -0.5).reshape(B, S, E)
        x = layer_norm(x + linear(ctx, self.o_w[...], self.o_b[...]), self.attn_ln_w[...], self.attn_ln_b[...],
                       cfg.layer_norm_eps)
        h = jax.nn.gelu(linear(x, self.up_w[...], self.up_b[...]), approximate=False)
        return layer_norm(x + linear(h, self.down_w[...], self.down_b[...]), self.out_ln_w[...],
                          self.out_ln_b[...], cfg.layer_norm_eps)


class Encoder(nnx.Module):
    """A BERT-family encoder (module docstring); build it with `from_hf_tensors`."""

    def __init__(self, config: EncoderConfig, dtype: Any = jnp.float32):
        c = config
        self.config, self.dtype = config, dtype
        z = lambda *shape: nnx.Param(jnp.zeros(shape, dtype))
        self.word = z(c.vocab_size, c.hidden_size)
        self.position = z(c.max_position_embeddings, c.hidden_size)
        self.token_type = z(c.type_vocab_size, c.hidden_size)
        self.emb_ln_w, self.emb_ln_b = z(c.hidden_size), z(c.hidden_size)
        self.layers = nnx.List([EncoderLayer(c, dtype) for _ in range(c.num_layers)])
        if c.num_labels:   # dense + tanh on the first token, then the label projection
            self.head_w, self.head_b = z(c.hidden_size, c.hidden_size), z(c.hidden_size)
            self.out_w, self.out_b = z(c.num_labels, c.hidden_size), z(c.num_labels)

    def __call__(self, input_ids: jax.Array, type_ids: jax.Array, lengths: jax.Array) -> jax.Array:
        """Hidden states [B, S, hidden] of a right-padded batch (row b holds lengths[b] tokens)."""
        cfg = self.config
        S = input_ids.shape[1]
        mask = jnp.arange(S)[None, :] < lengths[:, None]
        positions = jnp.arange(S) + cfg.position_offset
        x = (self.word[...][input_ids] + self.position[...][positions][None] + self.token_type[...][type_ids])
        x = layer_norm(x.astype(self.dtype), self.emb_ln_w[...], self.emb_ln_b[...], cfg.layer_norm_eps)
        bias = jnp.where(mask, 0.0, -1e30).astype(jnp.float32)[:, None, None, :]   # [B, 1, 1, S] over keys
        for layer in self.layers:
            x = layer(x, bias, cfg)
        return x

    def pool(self, hidden: jax.Array, lengths: jax.Array, pooling: str) -> jax.Array:
        """One float32 vector per row: the mean of its tokens, its first, its last, or their max."""
        h = hidden.astype(jnp.float32)
        mask = (jnp.arange(h.shape[1])[None, :] < lengths[:, None])[..., None]
        if pooling == "mean":
            return jnp.sum(jnp.where(mask, h, 0.0), axis=1) / jnp.maximum(lengths, 1)[:, None].astype(jnp.float32)
        if pooling == "cls":
            return h[:, 0]
        if pooling == "last":
            return jnp.take_along_axis(h, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
        if pooling == "max":
            return jnp.max(jnp.where(mask, h, -jnp.inf), axis=1)
        raise ValueError(f"pooling {pooling!r}: expected one of {POOLINGS}")

    def classify(self, hidden: jax.Array) -> jax.Array:
        """The sequence-classification logits [B, num_labels] (float32) from the first token."""
        h = jnp.tanh(linear(hidden[:, 0], self.head_w[...], self.head_b[...]))
        return linear(h, self.out_w[...], self.out_b[...], out_dtype=jnp.float32)

    @classmethod
    def from_hf_tensors(cls, config: EncoderConfig, weights: WeightSource, dtype: Any = jnp.float32) -> "Encoder":
        """Build from HF-named tensors: bare (`embeddings.…`) or under a `bert.` / `roberta.` prefix."""
        model = nnx.eval_shape(lambda: cls(config, dtype))
        pre = next((p for p in ("", "bert.", "roberta.", "model.")
                    if p + "embeddings.word_embeddings.weight" in weights), None)
        if pre is None:
            raise ModelLoadError(f"{weights.source}: no embeddings.word_embeddings.weight (with or without a "
                                 "bert. / roberta. prefix)")

        def put(param: nnx.Param, *names: str) -> None:
            parts = [weights.tensor(n) for n in names]
            value = parts[0] if len(parts) == 1 else np.concatenate(parts)
            if value.shape != tuple(param.shape):
                raise ModelLoadError(f"{weights.source}: {names[0]} has shape {value.shape}, expected {param.shape}")
            param.set_value(jnp.asarray(value, dtype))

        e = pre + "embeddings."
        put(model.word, e + "word_embeddings.weight")
        put(model.position, e + "position_embeddings.weight")
        put(model.token_type, e + "token_type_embeddings.weight")
        put(model.emb_ln_w, e + "LayerNorm.weight")
        put(model.emb_ln_b, e + "LayerNorm.bias")
        for i, layer in enumerate(model.layers):
            p = f"{pre}encoder.layer.{i}."
            put(layer.qkv_w, *(f"{p}attention.self.{n}.weight" for n in ("query", "key", "value")))
            put(layer.qkv_b, *(f"{p}attention.self.{n}.bias" for n in ("query", "key", "value")))
            put(layer.o_w, p + "attention.output.dense.weight")
            put(layer.o_b, p + "attention.output.dense.bias")
            put(layer.attn_ln_w, p + "attention.output.LayerNorm.weight")
            put(layer.attn_ln_b, p + "attention.output.LayerNorm.bias")
            put(layer.up_w, p + "intermediate.dense.weight")
            put(layer.up_b, p + "intermediate.dense.bias")
            put(layer.down_w, p + "output.dense.weight")
            put(layer.down_b, p + "output.dense.bias")
            put(layer.out_ln_w, p + "output.LayerNorm.weight")
            put(layer.out_ln_b, p + "output.LayerNorm.bias")
        if config.num_labels:
            if "classifier.out_proj.weight" in weights:   # RoBERTa's head: classifier.dense + out_proj
                dense, out = "classifier.dense.", "classifier.out_proj."
            else:                                          # BERT's: the pooler, then the classifier
                dense, out = pre + "pooler.dense.", "classifier."
            put(model.head_w, dense + "weight")
            put(model.head_b, dense + "bias")
            put(model.out_w, out + "weight")
            put(model.out_b, out + "bias")
        return model
