"""logit_lens: what each layer would predict. The final norm and LM head read the residual after
every layer, at the row that sampled a token; per layer the raw distribution's rank, logprob and
entropy of the sampled token, and its top tokens.

A separate one-token program ("lens", runtime/execution/step.py) re-runs the forward on the sampled token's
input row (its position p, the KV cache before it) with the model's per-layer residuals
collected, after the step that sampled it has been read. It never writes the sequence's KV: the
row's own K/V go to a scratch slot of the null block (block 0, which only padding reads, masked),
so the live cache and the prefix cache are untouched whatever the re-run computes. Attention reads
the prefix through the block table as the step did; the last layer's entry is then the step's own
raw distribution (tests/test_logit_lens.py pins it).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from imp_jax.runtime.execution.batch import SeqChunk, build_step_batch
from imp_jax.runtime.request import LensLayer

LENS_TOP = 20    # top tokens computed per layer; a request reads as many as it asked for
SCRATCH_SLOT = 0  # block 0, offset 0: where the re-run's own K/V go (never a live block)


def supports_lens(model: Any) -> bool:
    """Whether the model (or model class) can return its per-layer residuals (`residuals=True`, model/architectures/llama.py)."""
    cls = model if isinstance(model, type) else type(model)
    try:
        return "residuals" in inspect.signature(cls.__call__).parameters
    except (TypeError, ValueError):
        return False


def lens_forward(model: Any, input_ids: jax.Array, positions: jax.Array, kv: Any, meta: Any,
                 lora_ids: jax.Array | None) -> tuple[jax.Array, Any]:
    """Float32 logits [L, V] of token row 0's residual after each layer, and the cache."""
    if lora_ids is None:
        _, kv, stack = model(input_ids, positions, kv, meta, residuals=True)
        return model.logits(stack[:, 0]), kv
    _, kv, stack = model(input_ids, positions, kv, meta, lora_ids=lora_ids, residuals=True)
    return model.logits(stack[:, 0], lora_ids=jnp.broadcast_to(lora_ids[0], stack.shape[:1])), kv


def lens_readout(logits: jax.Array, target: jax.Array) -> tuple[jax.Array, ...]:
    """Per layer of `logits` [L, V] (raw): the target's logprob and rank (1 = most likely), the
    entropy in nats, and the top LENS_TOP (ids, logprobs)."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    lp = logprobs[:, target]
    rank = jnp.sum(logprobs > lp[:, None], axis=-1).astype(jnp.int32) + 1
    p = jnp.exp(logprobs)
    entropy = -jnp.sum(jnp.where(p > 0, p * logprobs, 0.0), axis=-1)
    top_lp, top_ids = jax.lax.top_k(logprobs, min(LENS_TOP, logits.shape[-1]))
    return lp, rank, entropy, top_ids.astype(jnp.int32), top_lp


def lens_batch(token_ids: list[int], block_ids: list[int], lora_slot: int, max_blocks: int, block_size: int):
    """The one-token batch that re-runs the newest input row of a sequence whose known tokens are
    `token_ids` (the sampled token last): position p = len - 2, KV 0..p-1 read through the table,
    its own K/V written to the scratch slot."""
    p = len(token_ids) - 2
    batch = build_step_batch([SeqChunk([token_ids[p]], p, block_ids, lora_slot)], num_tokens=1, num_seqs=1,
                             max_blocks=max_blocks, block_size=block_size, with_tables=False)
    batch.slot_mapping[0] = SCRATCH_SLOT
    return batch


def lens_layers(run: Callable[..., tuple[np.ndarray, ...]], batch: Any, token: int, top_n: int) -> list[LensLayer]:
    """Run the lens program (`CompiledStep.lens`) and read its layers for the sampled `token`."""
    lp, rank, entropy, top_ids, top_lp = run(batch, token)
    return [LensLayer(int(rank[i]), float(lp[i]), float(entropy[i]),
                      [(int(t), float(v)) for t, v in zip(top_ids[i, :top_n], top_lp[i, :top_n])])
            for i in range(len(lp))]
