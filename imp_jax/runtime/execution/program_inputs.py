"""What the compiled programs take from the host each call: the step's, scoring's and the logit lens' input
trees, built from a StepBatch, and the packed layout each (program, T, S) was compiled for (packing.py).

The step program's tree depends on what the model sees: with an image pool each token row's `embed_src`
(-1: its token's own embedding), with `bidirectional_images` also its `key_limit`, with `mrope` positions
[3, T] (runtime/execution/step.py's CompiledStep docstring). A padding-only batch of a (T, S) program gives
the layout its program is compiled for; every later call is checked against it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from imp_jax.runtime.execution.batch import StepBatch, build_step_batch
from imp_jax.runtime.execution.packing import Layout, pack
from imp_jax.runtime.execution.sampling import SamplingTensors, build_sampling_tensors
from imp_jax.runtime.request import MAX_LOGIT_BIAS


@dataclasses.dataclass(frozen=True)
class StepShapes:
    """Static sizes shared by every bucket."""

    max_blocks: int
    vocab_size: int
    history_len: int = 256
    max_bias: int = MAX_LOGIT_BIAS


class ProgramInputs:
    """The input trees of the step, score and lens programs, and their packed layouts."""

    def __init__(self, shapes: StepShapes, block_size: int, *, images: bool, mrope: bool,
                 bidirectional_images: bool, with_lora: bool):
        self.shapes, self.block_size = shapes, block_size
        self.images, self.mrope, self.bidirectional_images = images, mrope, bidirectional_images
        self.with_lora = with_lora
        self._layouts: dict[tuple[str, int, int], Layout] = {}

    def empty_batch(self, T: int, S: int) -> StepBatch:
        """An all-padding batch of a (T, S) program (it writes no KV and edits no table)."""
        return build_step_batch([], num_tokens=T, num_seqs=S, max_blocks=self.shapes.max_blocks,
                                block_size=self.block_size, with_tables=False)

    def dummy_sampling(self, rows: int) -> SamplingTensors:
        """Sampling tensors for `rows` padding rows (warm-up runs, layouts)."""
        s = self.shapes
        return build_sampling_tensors([], num_rows_bucket=rows, vocab_size=s.vocab_size,
                                      history_len=s.history_len, max_bias=s.max_bias, with_mask=True)

    def layout(self, program: str, T: int, S: int, attach_tables: Callable[[StepBatch], None]) -> Layout:
        """Where the packed inputs of `program` ("step", "score" or "lens") for (T, S) lie (the same every call);
        `attach_tables` gives a batch its table rows and edits, as a call would."""
        key = (program, T, S)
        if key not in self._layouts:
            batch = self.empty_batch(T, S)
            attach_tables(batch)
            tree = (self.step(batch, self.dummy_sampling(S), (0, 0)) if program == "step"
                    else self.lens(batch, 0) if program == "lens"
                    else self.score(batch, np.zeros(T, np.int32)))
            self._layouts[key] = pack(tree)[0]
        return self._layouts[key]

    def pack(self, program: str, tree: Any) -> tuple[np.ndarray, np.ndarray]:
        """The packed buffers of `tree`, checked against the layout the program was compiled for."""
        layout, ints, floats = pack(tree)
        T, S = len(tree[0]), len(tree[2][1])
        if layout != self._layouts.get((program, T, S)):
            raise ValueError(f"the {program} inputs for T={T} S={S} do not match the compiled layout")
        return ints, floats

    def step(self, batch: StepBatch, sampling: SamplingTensors, seed: tuple[int, int],
             follow: tuple[np.ndarray, np.ndarray] | None = None,
             cfg: tuple[np.ndarray, np.ndarray] | None = None,
             embed_src: np.ndarray | None = None,
             mrope_positions: np.ndarray | None = None,
             key_limit: np.ndarray | None = None) -> tuple[Any, ...]:
        """The step program's inputs (CompiledStep.launch says what each optional one is); `seed` = (the
        engine's base seed, the step number)."""
        T, S = len(batch.input_ids), len(batch.seq_lens)
        positions = batch.positions
        if self.mrope:
            positions = (np.asarray(mrope_positions, np.int32) if mrope_positions is not None
                         else np.broadcast_to(batch.positions, (3, T)).astype(np.int32))
        src, hist_pos = follow if follow is not None else (np.full(T, -1, np.int32), np.full(S, -1, np.int32))
        cfg = cfg if cfg is not None else (np.full(S, -1, np.int32), np.ones(S, np.float32))
        per_token = lambda a: np.full(T, -1, np.int32) if a is None else np.asarray(a, np.int32)   # noqa: E731
        images = (per_token(embed_src),) if self.images else ()
        if self.bidirectional_images:
            images += (per_token(key_limit),)
        return (batch.input_ids, positions, _meta(batch), batch.table_rows, batch.table_edits,
                batch.last_token_rows, sampling, np.array([s % 2**32 for s in seed], np.uint32),
                batch.lora_ids if self.with_lora else None, src, hist_pos, cfg, *images)

    def lens(self, batch: StepBatch, token: int) -> tuple[Any, ...]:
        return (batch.input_ids, batch.positions, _meta(batch), batch.table_rows, batch.table_edits,
                np.asarray(token, np.int32), batch.lora_ids if self.with_lora else None)

    def score(self, batch: StepBatch, targets: np.ndarray) -> tuple[Any, ...]:
        return (batch.input_ids, batch.positions, _meta(batch), batch.table_rows, batch.table_edits,
                np.asarray(targets, np.int32), batch.lora_ids if self.with_lora else None)


def _meta(batch: StepBatch) -> tuple[np.ndarray, ...]:
    """AttentionMetadata's host fields (its block tables come from the device rows)."""
    return batch.query_start_loc, batch.seq_lens, batch.slot_mapping, batch.num_seqs
