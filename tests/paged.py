"""Test helpers: run a model on ragged chunks through the paged cache, like the engine will."""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from imp_jax.kernels_pallas import AttentionMetadata, Kernels, select_kernels
from imp_jax.model.config import ModelConfig
from imp_jax.model.loader import attention_shape
from imp_jax.runtime.batch import SeqChunk, build_step_batch


def host_kernels(cfg: ModelConfig, dtype=jnp.float32) -> Kernels:
    """The kernels an engine on this host picks for `cfg` (the C++ ones on an x86-64 CPU)."""
    device = jax.local_devices()[0]
    return select_kernels(device, attention_shape(cfg, dtype, dtype, 16, device.platform))


class PagedRunner:
    """Owns a KV cache and a jitted forward; `run(chunks)` returns logits of every real token."""

    def __init__(self, model, *, num_blocks: int = 64, block_size: int = 16, max_blocks: int = 32):
        self.block_size, self.max_blocks = block_size, max_blocks
        shape = model.kv_cache_shape(num_blocks, block_size)
        self.kv = (jnp.zeros(shape, model.dtype), jnp.zeros(shape, model.dtype))
        graphdef, self.state = nnx.split(model)

        def forward(state, kv, input_ids, positions, meta, lora_ids):
            m = nnx.merge(graphdef, state)
            if getattr(m, "lora", None) is not None:   # LoRA slabs: each token's slot (SeqChunk.lora_slot)
                hidden, kv = m(input_ids, positions, kv, meta, lora_ids=lora_ids)
                return m.logits(hidden, lora_ids=lora_ids), kv
            hidden, kv = m(input_ids, positions, kv, meta)
            return m.logits(hidden), kv

        self._forward = jax.jit(forward, donate_argnums=1)

    def run(self, chunks: Sequence[SeqChunk], num_tokens: int = 64, num_seqs: int = 8) -> list[np.ndarray]:
        """Logits [len(chunk.token_ids), vocab] for each chunk, from one ragged model call."""
        b = build_step_batch(chunks, num_tokens=num_tokens, num_seqs=num_seqs,
                             max_blocks=self.max_blocks, block_size=self.block_size)
        meta = AttentionMetadata(jnp.asarray(b.query_start_loc), jnp.asarray(b.seq_lens),
                                 jnp.asarray(b.block_tables), jnp.asarray(b.slot_mapping),
                                 jnp.asarray(b.num_seqs))
        logits, self.kv = self._forward(self.state, self.kv, jnp.asarray(b.input_ids),
                                        jnp.asarray(b.positions), meta, jnp.asarray(b.lora_ids))
        logits = np.asarray(logits)
        return [logits[b.query_start_loc[i]:b.query_start_loc[i + 1]] for i in range(len(chunks))]
