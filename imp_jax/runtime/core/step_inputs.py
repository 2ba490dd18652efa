"""A scheduled step's inputs: the batch (token ids, positions, block tables) and one sampling row per
sampled token, each row's knobs from its sequence's params plus what the decoding features add
(runtime/features/). Built on the engine thread while the previous step runs on the device."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import numpy as np

from imp_jax.runtime.execution.batch import SeqChunk, StepBatch, build_step_batch
from imp_jax.runtime.features import Feature, Services
from imp_jax.runtime.request import SamplingParams
from imp_jax.runtime.execution.sampling import RowSpec, SamplingTensors, build_sampling_tensors
from imp_jax.runtime.scheduling.scheduler import ScheduledChunk
from imp_jax.runtime.scheduling.sequence import Sequence

log = logging.getLogger("imp_jax.engine")


@dataclasses.dataclass
class StepInputs:
    """What `StepBuilder.build` makes for one launch."""

    batch: StepBatch
    sampling: SamplingTensors
    follow: tuple[np.ndarray, np.ndarray] | None   # pending tokens: (token row -> prev's output row, history slot)
    samples: list[bool]                 # per chunk: the step samples the sequence's next token
    decode_rows: int
    extra_rows: list[int]               # per chunk: its drafts' first sampled row, or -1
    extras: dict[str, Any]              # the features' launch inputs (Feature.step_extras)
    failed: list[tuple[Sequence, BaseException]]   # sequences whose row could not be built (their requests fail)


def slice_ids(seq: Sequence, start: int, n: int) -> list[int]:
    """The known token ids start..start+n-1 of `seq` (fewer at its end), without joining prompt and output."""
    k = len(seq.prompt_ids)
    if start >= k:
        return seq.output_ids[start - k:start - k + n]
    return seq.prompt_ids[start:start + n] + (seq.output_ids[:start + n - k] if start + n > k else [])


def base_bias(p: SamplingParams, num_output: int, eos_ids) -> dict[int, float]:
    """The request's logit_bias, plus a ban on EOS and stop token ids until min_tokens are out, plus a bias of
    0 (a probe: the sampler reports its raw logprob) on each raw_logprob_ids entry, in the first slots."""
    bias = {**dict.fromkeys(p.raw_logprob_ids, 0.0), **p.logit_bias} if p.raw_logprob_ids else p.logit_bias
    if num_output < p.min_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
        bias = {**bias, **dict.fromkeys(banned, float("-inf"))}
    return bias


def _has_penalty(p: SamplingParams) -> bool:
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1


class StepBuilder:
    """Builds each step's inputs; `inject` is the failures' test hook (StepFailures.inject), called per sampled row."""

    def __init__(self, services: Services, features: list[Feature], inject: Callable[[str, list[Sequence]], None]):
        self.s = services
        self.features = features
        self.inject = inject

    def build(self, chunks: list[ScheduledChunk], prev_tokens: bool) -> StepInputs:
        """A pending token (sampled by the step in flight, not read yet) gets id 0 here and `follow` points its
        row at that step's output row (and a penalised row's history slot).

        Chunk i samples row i (at its last token; a verify chunk's at its newest known token); a verify
        chunk's drafts sample rows after every chunk's, from `extra_rows[i]` on, each seeing the drafts
        before it (runtime/decoding/speculative.py)."""
        step_fn = self.s.step_fn
        num_drafts = sum(len(c.drafts) for c in chunks)
        longest = max((c.seq.num_computed + c.num_tokens for c in chunks), default=0)   # its KV after the step
        T, S = step_fn.bucket_for(sum(c.num_tokens for c in chunks), len(chunks) + num_drafts, longest)
        src = np.full(T, -1, np.int32)
        hist_pos = np.full(S, -1, np.int32)
        seq_chunks, rows, samples, extra_rows, extra_specs, failed = [], [], [], [], [], []
        masks: dict[int, np.ndarray] = {}
        sampling_rows = [(i, c.seq) for i, c in enumerate(chunks) if c.samples]
        for f in self.features:
            f.masks(sampling_rows, masks)
        t = decode_rows = 0
        for i, c in enumerate(chunks):
            seq = c.seq
            ids = slice_ids(seq, seq.num_computed, c.num_tokens - len(c.drafts))
            missing = c.num_tokens - len(c.drafts) - len(ids)   # the newest token, sampled by prev, not read yet
            if missing:
                if missing != 1 or not prev_tokens or seq.pending != 1:
                    raise RuntimeError(f"sequence {seq.seq_id}: {missing} unknown tokens scheduled")
                ids = ids + [0]
                src[t + c.num_tokens - 1] = seq.pending_row
            if c.drafts:
                extra_rows.append(len(chunks) + len(extra_specs))
                extra_specs += [self.row_spec(seq, None, ahead=c.drafts[:j + 1]) for j in range(len(c.drafts))]
                ids = ids + list(c.drafts)
            else:
                extra_rows.append(-1)
            seq_chunks.append(SeqChunk(ids, seq.num_computed, seq.table.block_ids, seq.lora_slot))
            samples.append(c.samples)
            row = RowSpec(temperature=0.0)   # a CFG shadow's row only lends its logits
            if c.samples and seq.main is None:
                try:
                    self.inject("prepare", [seq])
                    row = self.row_spec(seq, masks.get(i), pending=missing)
                except Exception as e:   # this sequence's host work: its request fails, the step goes on
                    failed.append((seq, e))
                    row = RowSpec(temperature=0.0)
                if missing and row.history:
                    hist_pos[i] = len(row.history) - 1
            rows.append(row)
            decode_rows += not seq.is_prefill
            t += c.num_tokens
        batch = build_step_batch(seq_chunks, num_tokens=T, num_seqs=S, max_blocks=step_fn.shapes.max_blocks,
                                 block_size=self.s.config.block_size, with_tables=False)
        for i, c in enumerate(chunks):
            if c.drafts:   # row i verifies the first draft at the newest known token; the rest follow
                start = int(batch.query_start_loc[i])
                batch.last_token_rows[i] = start
                e = extra_rows[i]
                batch.last_token_rows[e:e + len(c.drafts)] = np.arange(start + 1, start + 1 + len(c.drafts))
        shapes = step_fn.shapes
        sampling = build_sampling_tensors(rows + extra_specs, num_rows_bucket=S, vocab_size=shapes.vocab_size,
                                          history_len=shapes.history_len, max_bias=shapes.max_bias, with_mask=True)
        extras: dict[str, Any] = {}
        for f in self.features:
            extras.update(f.step_extras(chunks, len(batch.seq_lens)))
            extras.update(f.token_extras(chunks, T, failed))
        follow = (src, hist_pos) if prev_tokens else None
        return StepInputs(batch, sampling, follow, samples, decode_rows, extra_rows, extras, failed)

    def row_spec(self, seq: Sequence, mask: np.ndarray | None, pending: int = 0,
                 ahead: tuple[int, ...] = ()) -> RowSpec:
        """`pending`: the sequence's newest token is not read yet (its history slot holds 0 here; the step
        fills it on the device). `ahead`: the drafts before this row (a verify row samples as if they were
        output: in its penalties' history, min_tokens count and seeded position)."""
        p = seq.params
        H = self.s.step_fn.shapes.history_len
        n_out = len(seq.output_ids) + pending + len(ahead)
        history = ()
        if _has_penalty(p):
            known = slice_ids(seq, max(0, seq.num_known - H + pending + len(ahead)), H)
            history = (known + [0] * pending + list(ahead))[-H:]
        fields: dict[str, Any] = dict(
            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
            typical_p=p.typical_p, presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty,
            seed=p.seed, position=seq.num_tokens + len(ahead),
            history=history, num_output_tokens=n_out if history else 0,
            logit_bias=base_bias(p, n_out, self.s.tokenizer.eos_ids), wants_top_logprobs=p.logprobs is not None,
            allowed_bitmask=mask)
        for f in self.features:
            f.row(seq, fields, n_out)
        return RowSpec(**fields)
