"""A user model (--model-class support.scripted_model:ScriptedLM) whose greedy reply is a fixed token script.

Why: a random tiny model cannot be made to write harmony, and a first-order token chain (the thinking
model of tiny_models) cannot either: harmony repeats `<|start|>assistant<|channel|>` with a different
channel after it. This model reads further back, through the paged KV cache: its one attention head finds
the newest trigger token in the context (a key that grows with position, only on trigger tokens), and the
logits are one-hot on that trigger's script at the current offset past it. So the engine, sampler, trackers
and server all run for real on a reply the test chose. Scripts and triggers are its weights.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from imp_jax.kernels_pallas import AttentionMetadata, ragged_paged_attention
from imp_jax.model.base import KVCache, ModelOptions
from imp_jax.model.config import ModelConfig
from imp_jax.model.weights import WeightSource

MAX_SCRIPTS, SCRIPT_LEN = 4, 96
HEAD_DIM = 8            # [trigger position, script one-hot (MAX_SCRIPTS), unused]
ALPHA = 50.0            # the newest trigger outweighs the one before it by exp(ALPHA)


class ScriptedLM(nnx.Module):
    """logits(row) = onehot(script[trigger][position - trigger position]) of the newest trigger in context."""

    def __init__(self, config: ModelConfig, options: ModelOptions | None = None, *, rngs: nnx.Rngs):
        self.config, self.options = config, options or ModelOptions()
        self.triggers = nnx.Param(jnp.full((MAX_SCRIPTS,), -1, jnp.int32))
        self.scripts = nnx.Param(jnp.zeros((MAX_SCRIPTS, SCRIPT_LEN), jnp.int32))

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (1, num_blocks, block_size, 1, HEAD_DIM)

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv: KVCache,
                 meta: AttentionMetadata) -> tuple[jax.Array, KVCache]:
        T = input_ids.shape[0]
        match = (input_ids[:, None] == self.triggers[...][None, :]).astype(jnp.float32)   # [T, MAX_SCRIPTS]
        is_trigger = match.sum(-1)
        pos = positions.astype(jnp.float32)
        q = jnp.zeros((T, 1, HEAD_DIM), jnp.float32).at[:, 0, 0].set(1.0)
        k = jnp.zeros((T, 1, HEAD_DIM), jnp.float32).at[:, 0, 0].set(ALPHA * (pos + 1) * is_trigger)
        v = jnp.zeros((T, 1, HEAD_DIM), jnp.float32).at[:, 0, 0].set(pos).at[:, 0, 1:1 + MAX_SCRIPTS].set(match)
        attn, k_cache, v_cache = ragged_paged_attention(q, k, v, *kv, meta, 0, sm_scale=1.0,
                                                        kernels=self.options.kernels)
        hidden = jnp.concatenate([attn[:, 0, :], pos[:, None]], axis=-1)   # [T, HEAD_DIM + 1]
        return hidden, (k_cache, v_cache)

    def logits(self, hidden: jax.Array) -> jax.Array:
        script = jnp.argmax(hidden[:, 1:1 + MAX_SCRIPTS], axis=-1)
        offset = jnp.clip(jnp.round(hidden[:, HEAD_DIM] - hidden[:, 0]).astype(jnp.int32), 0, SCRIPT_LEN - 1)
        token = self.scripts[...][script, offset]
        return jax.nn.one_hot(token, self.config.vocab_size, dtype=jnp.float32) * 30.0

    @classmethod
    def from_hf_tensors(cls, config: ModelConfig, weights: WeightSource,
                        options: ModelOptions | None = None) -> ScriptedLM:
        model = cls(config, options, rngs=nnx.Rngs(0))
        model.triggers.set_value(jnp.asarray(weights.tensor("triggers"), jnp.int32))
        model.scripts.set_value(jnp.asarray(weights.tensor("scripts"), jnp.int32))
        return model


def write_scripted_model(path: Path, vocab_size: int, scripts: dict[int, Sequence[int]], pad: int) -> None:
    """config.json and model.safetensors for ScriptedLM: `scripts` maps a trigger token to the tokens that
    follow it (those the prompt already holds first), padded with `pad` (an EOS)."""
    import numpy as np
    from safetensors.numpy import save_file

    assert len(scripts) <= MAX_SCRIPTS
    triggers = np.full((MAX_SCRIPTS,), -1, np.float32)
    table = np.full((MAX_SCRIPTS, SCRIPT_LEN), pad, np.float32)
    for i, (trigger, script) in enumerate(scripts.items()):
        assert len(script) < SCRIPT_LEN
        triggers[i], table[i, :len(script)] = trigger, script
    save_file({"triggers": triggers, "scripts": table}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": HEAD_DIM + 1, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
        "num_key_value_heads": 1, "head_dim": HEAD_DIM, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6, "torch_dtype": "float32"}))
