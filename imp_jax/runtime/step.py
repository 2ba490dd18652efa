"""The compiled step: forward + gather of the rows to sample + sampler, one program per shape bucket.

Every (token-count, sequence-count) bucket is compiled ahead of time at start-up; serving
looks executables up and never traces. A counter of compilations after warm-up proves it.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from imp_jax.kernels_pallas import AttentionMetadata
from imp_jax.runtime.batch import StepBatch, build_step_batch, pow2_buckets
from imp_jax.runtime.request import MAX_LOGIT_BIAS
from imp_jax.runtime.sampling import SamplerOutput, SamplingTensors, build_sampling_tensors, sample
from imp_jax.runtime.sharding import kv_sharding, replicated, state_shardings

log = logging.getLogger("imp_jax.step")
NUM_TOP_LOGPROBS = 20   # always computed; each request reads as many as it asked for


@dataclasses.dataclass(frozen=True)
class StepShapes:
    """Static sizes shared by every bucket."""

    max_blocks: int
    vocab_size: int
    history_len: int = 256
    max_bias: int = MAX_LOGIT_BIAS


class CompiledStep:
    """Owns the model state and the KV cache; runs one donated, in-place step per call.

    Two programs share the forward pass: `step` (logits of the sampled rows -> sampler) per
    (T, S) bucket, and `score` (raw logprobs of every row, for prompt_logprobs) for one bucket.
    Every array has an explicit sharding on `mesh` (runtime/sharding.py).
    """

    def __init__(self, model: Any, kv: tuple[jax.Array, jax.Array], shapes: StepShapes,
                 buckets: list[tuple[int, int]], mesh: Mesh):
        self.graphdef, state = nnx.split(model)
        self.shapes = shapes
        self.buckets = sorted(buckets)
        self.mesh = mesh
        state_sh, kv_sh, rep = state_shardings(state, mesh), kv_sharding(mesh), replicated(mesh)
        self.state = jax.device_put(state, state_sh)
        self.kv = jax.device_put(kv, (kv_sh, kv_sh))
        self._exec: dict[tuple[int, int], Any] = {}
        self.compilations_after_warmup = 0
        self._warm = False
        graphdef = self.graphdef
        dynamic_skips = model.options.kernels.dynamic_skips

        def forward(state, kv, input_ids, positions, meta):
            model = nnx.merge(graphdef, state)
            hidden, kv = model(input_ids, positions, kv, meta)
            return model, hidden, kv

        def step(state, kv, input_ids, positions, meta, rows, sampling, step_no):
            model, hidden, kv = forward(state, kv, input_ids, positions, meta)
            logits = model.logits(hidden[rows])
            key = jax.random.fold_in(jax.random.key(0), step_no)
            return sample(logits, sampling, key, NUM_TOP_LOGPROBS, dynamic_skips=dynamic_skips), kv

        def score(state, kv, input_ids, positions, meta, targets):
            model, hidden, kv = forward(state, kv, input_ids, positions, meta)
            logprobs = jax.nn.log_softmax(model.logits(hidden), axis=-1)   # raw: no sampling knobs
            target = jnp.take_along_axis(logprobs, targets[:, None], axis=-1)
            rank = jnp.sum(logprobs > target, axis=-1) + 1
            top_lp, top_ids = jax.lax.top_k(logprobs, NUM_TOP_LOGPROBS)
            return (target[:, 0], rank.astype(jnp.int32), top_ids.astype(jnp.int32), top_lp), kv

        model_in = (state_sh, (kv_sh, kv_sh), rep, rep, rep)   # state, kv, input_ids, positions, meta
        self._step_jit = jax.jit(step, donate_argnums=(1,), in_shardings=(*model_in, rep, rep, rep),
                                 out_shardings=(rep, (kv_sh, kv_sh)))
        self._score_jit = jax.jit(score, donate_argnums=(1,), in_shardings=(*model_in, rep),
                                  out_shardings=(rep, (kv_sh, kv_sh)))
        self._score_exec: Any = None
        self.score_tokens = self.buckets[-1][0]   # prompt logprobs run one sequence, chunk by chunk

    def warm_up(self, progress: Callable[[int, int, tuple[int, int], float], None] | None = None) -> None:
        """Compile every bucket now (from the persistent cache when it has them) and run it once.

        The run is on an all-padding batch, which writes no KV: a program's first run costs more
        than later ones (docs/PERF.md), and that belongs to start-up, not to the first request
        that lands in the bucket.
        """
        for i, bucket in enumerate(self.buckets):
            t0 = time.perf_counter()
            self._compile(bucket)
            self(build_step_batch([], num_tokens=bucket[0], num_seqs=bucket[1],
                                  max_blocks=self.shapes.max_blocks, block_size=self.kv[0].shape[2]),
                 self._dummy_sampling(bucket[1]), 0)
            if progress:
                progress(i + 1, len(self.buckets), bucket, time.perf_counter() - t0)
        self._score_exec = self._compile_score()
        self._warm = True

    def _lower(self, jitted: Any, T: int, S: int, *extra: Any) -> Any:
        """Compile `jitted` for T tokens over S sequence slots (counted once warm-up is over)."""
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
        meta = AttentionMetadata(i32(S + 1), i32(S), i32(S, self.shapes.max_blocks), i32(T), i32())
        exe = jitted.lower(self.state, self.kv, i32(T), i32(T), meta, *extra).compile()
        if self._warm:
            self.compilations_after_warmup += 1
            log.warning("compiled a program for T=%d S=%d after warm-up", T, S)
        return exe

    def _compile(self, bucket: tuple[int, int]) -> Any:
        T, S = bucket
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
        sampling = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self._dummy_sampling(S))
        self._exec[bucket] = self._lower(self._step_jit, T, S, i32(S), sampling, i32())
        return self._exec[bucket]

    def _compile_score(self) -> Any:
        T = self.score_tokens
        return self._lower(self._score_jit, T, 1, jax.ShapeDtypeStruct((T,), jnp.int32))

    def score(self, batch: StepBatch, targets: np.ndarray) -> tuple[np.ndarray, ...]:
        """Raw logprob and rank of `targets` [T] at every row, plus the top 20, for a one-sequence batch."""
        if self._score_exec is None:
            self._score_exec = self._compile_score()
        out, self.kv = self._score_exec(self.state, self.kv, batch.input_ids, batch.positions, _meta(batch),
                                        targets.astype(np.int32))
        return tuple(np.asarray(x) for x in out)

    def _dummy_sampling(self, rows: int) -> SamplingTensors:
        s = self.shapes
        return build_sampling_tensors([], num_rows_bucket=rows, vocab_size=s.vocab_size,
                                      history_len=s.history_len, max_bias=s.max_bias, with_mask=False)

    def bucket_for(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """The smallest compiled bucket holding this many tokens and sequences."""
        for T, S in self.buckets:
            if T >= num_tokens and S >= num_seqs:
                return T, S
        raise ValueError(f"no bucket holds {num_tokens} tokens and {num_seqs} sequences")

    def __call__(self, batch: StepBatch, sampling: SamplingTensors, step_no: int) -> SamplerOutput:
        """Run one step on host arrays; returns the sampler output as numpy arrays."""
        bucket = (len(batch.input_ids), len(batch.seq_lens))
        exe = self._exec.get(bucket) or self._compile(bucket)
        out, self.kv = exe(self.state, self.kv, batch.input_ids, batch.positions, _meta(batch),
                           batch.last_token_rows, sampling, np.asarray(step_no, np.int32))
        return SamplerOutput(*(np.asarray(x) for x in out))


def _meta(batch: StepBatch) -> AttentionMetadata:
    return AttentionMetadata(batch.query_start_loc, batch.seq_lens, batch.block_tables,
                             batch.slot_mapping, batch.num_seqs)


def step_buckets(max_num_batched_tokens: int, max_num_seqs: int, min_tokens: int = 16) -> list[tuple[int, int]]:
    """(T, S) pairs: T powers of two from 16 to the token budget times S powers of two up to
    max_num_seqs (S <= T), plus the decode diagonal T = S below 16.

    The diagonal matters on CPU, where a batch-1 decode padded to 16 rows runs its GEMMs several
    times slower than at 1 row (docs/PERF.md), and a pure-decode step has one token per sequence.
    """
    ts = pow2_buckets(min(min_tokens, max_num_batched_tokens), max_num_batched_tokens)
    ss = pow2_buckets(1, max_num_seqs)
    grid = [(t, s) for t in ts for s in ss if s <= t]
    diagonal = [(s, s) for s in ss if s < ts[0]]
    return sorted(set(grid + diagonal))
