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

from imp_jax.kernels_pallas import AttentionMetadata
from imp_jax.runtime.batch import StepBatch, build_step_batch, pow2_buckets
from imp_jax.runtime.request import MAX_LOGIT_BIAS
from imp_jax.runtime.sampling import SamplerOutput, SamplingTensors, build_sampling_tensors, sample

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
    """Owns the model state and the KV cache; runs one donated, in-place step per call."""

    def __init__(self, model: Any, kv: tuple[jax.Array, jax.Array], shapes: StepShapes,
                 buckets: list[tuple[int, int]]):
        self.graphdef, self.state = nnx.split(model)
        self.kv = kv
        self.shapes = shapes
        self.buckets = sorted(buckets)
        self._exec: dict[tuple[int, int], Any] = {}
        self.compilations_after_warmup = 0
        self._warm = False
        graphdef = self.graphdef

        def step(state, kv, input_ids, positions, meta, rows, sampling, step_no):
            model = nnx.merge(graphdef, state)
            hidden, kv = model(input_ids, positions, kv, meta)
            logits = model.logits(hidden[rows])
            key = jax.random.fold_in(jax.random.key(0), step_no)
            return sample(logits, sampling, key, NUM_TOP_LOGPROBS), kv

        def score(state, kv, input_ids, positions, meta, targets):
            model = nnx.merge(graphdef, state)
            hidden, kv = model(input_ids, positions, kv, meta)
            logprobs = jax.nn.log_softmax(model.logits(hidden), axis=-1)   # raw: no sampling knobs
            target = jnp.take_along_axis(logprobs, targets[:, None], axis=-1)
            rank = jnp.sum(logprobs > target, axis=-1) + 1
            top_lp, top_ids = jax.lax.top_k(logprobs, NUM_TOP_LOGPROBS)
            return (target[:, 0], rank.astype(jnp.int32), top_ids.astype(jnp.int32), top_lp), kv

        self._jit = jax.jit(step, donate_argnums=(1,))
        self._score_jit = jax.jit(score, donate_argnums=(1,))
        self._score_exec: Any = None
        self.score_tokens = self.buckets[-1][0]   # prompt logprobs run one sequence, chunk by chunk

    def warm_up(self, progress: Callable[[int, int, tuple[int, int], float], None] | None = None) -> None:
        """Compile every bucket now (from the persistent cache when it has them) and run it once.

        The run is on an all-padding batch, which writes no KV: a program's first run on a CPU
        costs ~0.4 s more than the later ones (a 256-token prefill: 0.81 s, then 0.37), and
        that belongs to start-up, not to the first request that lands in the bucket.
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

    def _compile(self, bucket: tuple[int, int]) -> Any:
        T, S = bucket
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
        meta = AttentionMetadata(i32(S + 1), i32(S), i32(S, self.shapes.max_blocks), i32(T), i32())
        sampling = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self._dummy_sampling(S))
        exe = self._jit.lower(self.state, self.kv, i32(T), i32(T), meta, i32(S), sampling, i32()).compile()
        self._exec[bucket] = exe
        if self._warm:
            self.compilations_after_warmup += 1
            log.warning("compiled bucket T=%d S=%d after warm-up", T, S)
        return exe

    def _compile_score(self) -> Any:
        T = self.score_tokens
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
        meta = AttentionMetadata(i32(2), i32(1), i32(1, self.shapes.max_blocks), i32(T), i32())
        if self._warm:
            self.compilations_after_warmup += 1
        return self._score_jit.lower(self.state, self.kv, i32(T), i32(T), meta, i32(T)).compile()

    def score(self, batch: StepBatch, targets: np.ndarray) -> tuple[np.ndarray, ...]:
        """Raw logprob and rank of `targets` [T] at every row, plus the top 20, for a one-sequence batch."""
        if self._score_exec is None:
            self._score_exec = self._compile_score()
        meta = AttentionMetadata(batch.query_start_loc, batch.seq_lens, batch.block_tables,
                                 batch.slot_mapping, batch.num_seqs)
        out, self.kv = self._score_exec(self.state, self.kv, batch.input_ids, batch.positions, meta,
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
        meta = AttentionMetadata(batch.query_start_loc, batch.seq_lens, batch.block_tables,
                                 batch.slot_mapping, batch.num_seqs)
        out, self.kv = exe(self.state, self.kv, batch.input_ids, batch.positions, meta,
                           batch.last_token_rows, sampling, np.asarray(step_no, np.int32))
        return SamplerOutput(*(np.asarray(x) for x in out))


def step_buckets(max_num_batched_tokens: int, max_num_seqs: int, min_tokens: int = 16) -> list[tuple[int, int]]:
    """(T, S) pairs: T powers of two from 16 to the token budget times S powers of two up to
    max_num_seqs (S <= T), plus the decode diagonal T = S below 16.

    The diagonal matters on CPU: a batch-1 decode padded to 16 rows ran its GEMMs ~8x slower
    than at 1 row, and a pure-decode step always has exactly one token per sequence.
    """
    ts = pow2_buckets(min(min_tokens, max_num_batched_tokens), max_num_batched_tokens)
    ss = pow2_buckets(1, max_num_seqs)
    grid = [(t, s) for t in ts for s in ss if s <= t]
    diagonal = [(s, s) for s in ss if s < ts[0]]
    return sorted(set(grid + diagonal))
