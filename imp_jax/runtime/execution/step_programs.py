"""The step's programs as pure functions of (parameters, KV cache, block tables, packed inputs): `step`
(forward, the sampled rows' logits, CFG, sampler), `score` (raw logprobs of every row: prompt_logprobs)
and `lens` (one token's per-layer readout: logit_lens). `CompiledStep` jits and compiles them per bucket.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from imp_jax.kernels_pallas import AttentionMetadata
from imp_jax.runtime.decoding.cfg import guide
from imp_jax.runtime.decoding.logit_lens import lens_forward, lens_readout
from imp_jax.runtime.execution.packing import unpack
from imp_jax.runtime.execution.sampling import sample
from imp_jax.runtime.parallel.sharding import kv_sharding, partition_spec

NUM_TOP_LOGPROBS = 20   # always computed; each request reads as many as it asked for


def model_forward(model: Any, graphdef: Any, treedef: Any) -> Callable:
    """The one forward pass every program (and the model tests, tests/paged.py) runs: (leaves, kv, input_ids,
    positions, meta, lora_ids, rows[, embed]) -> (logits of `rows`, None: every row; the updated cache). With LoRA
    slabs (model/lora.py) each token's adapter slot is an input; `embed` = (embed_rows, embed_slots) overrides
    token rows' embeddings (images: model/base.py); without either, the program is the one it always was."""
    with_lora = getattr(model, "lora", None) is not None

    def forward_logits(leaves, kv, input_ids, positions, meta, lora_ids, rows, embed=None):
        model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        extra = {} if embed is None else dict(embed_rows=embed[0], embed_slots=embed[1])
        if not with_lora:
            hidden, kv = model(input_ids, positions, kv, meta, **extra)
            return model.logits(hidden if rows is None else hidden[rows]), kv
        hidden, kv = model(input_ids, positions, kv, meta, lora_ids=lora_ids, **extra)
        if rows is not None:
            hidden, lora_ids = hidden[rows], lora_ids[rows]
        return model.logits(hidden, lora_ids=lora_ids), kv   # adapters on the LM head: each row's slot

    return forward_logits


def step_programs(model: Any, graphdef: Any, treedef: Any, leaves_: list[jax.Array], mesh: Mesh,
                  max_rows: int, bidirectional_images: bool = False) -> dict[str, Callable]:
    """The programs' functions for `model` split into (graphdef, flat leaves): each takes (leaves, kv, tables,
    ints, floats, prev, layout, context) and returns (outputs, kv, tables); `context` (static) is how many
    leading block-table columns the attention gets (runtime/execution/step.py, context buckets). On a mesh of more
    than one device the forward and the LM head run per shard under `shard_map`. With `bidirectional_images`
    the step's packed ints end with key_limit [T] after embed_src, which joins its AttentionMetadata."""
    dynamic_skips = model.options.kernels.dynamic_skips
    with_lora = getattr(model, "lora", None) is not None
    forward_logits = model_forward(model, graphdef, treedef)

    def forward_lens(leaves, kv, input_ids, positions, meta, lora_ids):
        """logit_lens: logits [L, V] of token row 0 after each layer (runtime/decoding/logit_lens.py)."""
        model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        return lens_forward(model, input_ids, positions, kv, meta, lora_ids if with_lora else None)

    if mesh.size > 1:
        kv_sh = kv_sharding(mesh)
        kv_spec = (kv_sh.spec, kv_sh.spec)
        logits_spec = partition_spec(getattr(model, "logits_axes", None), 2)
        forward_logits = jax.shard_map(
            forward_logits, mesh=mesh, check_vma=False,
            in_specs=([a.sharding.spec for a in leaves_], kv_spec, *[PartitionSpec()] * 5),
            out_specs=(logits_spec, kv_spec))
        forward_lens = jax.shard_map(
            forward_lens, mesh=mesh, check_vma=False,
            in_specs=([a.sharding.spec for a in leaves_], kv_spec, *[PartitionSpec()] * 4),
            out_specs=(logits_spec, kv_spec))

    def meta_of(tables, meta_in, table_rows, edits, context):
        """The step's AttentionMetadata, its rows (their first `context` columns) read from the device
        tables after this step's edits."""
        tables = tables.at[edits[0], edits[1]].set(edits[2], mode="drop")
        qsl, seq_lens, slot_mapping, num_seqs = meta_in
        return AttentionMetadata(qsl, seq_lens, tables[table_rows, :context], slot_mapping, num_seqs), tables

    def step(leaves, kv, tables, ints, floats, prev, layout, context, pool=None):
        (input_ids, positions, meta, table_rows, edits, rows, sampling, step_no, lora_ids, src, hist_pos,
         (cfg_rows, cfg_scale), *images) = unpack(layout, ints, floats)
        meta, tables = meta_of(tables, meta, table_rows, edits, context)
        if bidirectional_images:   # image tokens see their whole image (runtime/features/images.py)
            meta = dataclasses.replace(meta, key_limit=images[1])
        # asynchronous scheduling (engine.py): a token the host has not read yet is the previous
        # step's sample at row src (-1: the host's id); a penalised row's history gets it too
        input_ids = jnp.where(src >= 0, prev[jnp.maximum(src, 0)], input_ids)
        hist_rows = jnp.arange(hist_pos.shape[0])
        history = sampling.history.at[hist_rows, jnp.where(hist_pos >= 0, hist_pos, sampling.history.shape[1])
                                      ].set(input_ids[rows], mode="drop")
        sampling = dataclasses.replace(sampling, history=history)
        args = (leaves, kv, input_ids, positions, meta, lora_ids, rows)
        if pool is None:
            logits, kv = forward_logits(*args)
        else:   # images (runtime/scheduling/image_rows.py): token row t takes pool row embed_src[t] when >= 0
            embed_src = images[0]
            T = embed_src.shape[0]
            slots = jnp.where(embed_src >= 0, jnp.arange(T, dtype=jnp.int32), T)
            logits, kv = forward_logits(*args, (pool[jnp.maximum(embed_src, 0)], slots))
        logits = guide(logits, cfg_rows, cfg_scale, dynamic_skips)   # CFG rows (runtime/decoding/cfg.py); others as they are
        key = jax.random.fold_in(jax.random.key(step_no[0]), step_no[1])   # (base seed, step number)
        out = sample(logits, sampling, key, NUM_TOP_LOGPROBS, dynamic_skips=dynamic_skips)
        return (out, jnp.pad(out.tokens, (0, max_rows - out.tokens.shape[0]))), kv, tables

    def score(leaves, kv, tables, ints, floats, prev, layout, context):
        input_ids, positions, meta, table_rows, edits, targets, lora_ids = unpack(layout, ints, floats)
        meta, tables = meta_of(tables, meta, table_rows, edits, context)
        logits, kv = forward_logits(leaves, kv, input_ids, positions, meta, lora_ids, None)
        logprobs = jax.nn.log_softmax(logits, axis=-1)   # raw: no sampling knobs
        target = jnp.take_along_axis(logprobs, targets[:, None], axis=-1)
        rank = jnp.sum(logprobs > target, axis=-1) + 1
        top_lp, top_ids = jax.lax.top_k(logprobs, NUM_TOP_LOGPROBS)
        return (target[:, 0], rank.astype(jnp.int32), top_ids.astype(jnp.int32), top_lp), kv, tables

    def lens(leaves, kv, tables, ints, floats, prev, layout, context):
        input_ids, positions, meta, table_rows, edits, target, lora_ids = unpack(layout, ints, floats)
        meta, tables = meta_of(tables, meta, table_rows, edits, context)
        logits, kv = forward_lens(leaves, kv, input_ids, positions, meta, lora_ids)
        return lens_readout(logits, target), kv, tables


    return {"step": step, "score": score, "lens": lens}
