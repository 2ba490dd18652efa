"""The decoding-feature protocol: what a feature tells the engine loop, over a request's whole life.

A feature (grammar, think budget, DRY, mirostat, banned phrases, CFG, logit lens, speculation,
adapters, prompt scoring, ...) is one module with one `Feature` subclass, listed once in
`features/__init__.py`. The loop never names a feature: it calls these hooks, in the registry's order.
Every hook is a no-op by default, so a feature overrides only what it needs.

Life of a request, and the hook the loop calls at each point (all on the engine thread, each bounded
per call; unbounded work belongs in `prepare`, run before admission on a worker thread):
1. admission: `check` validates the request (raise InvalidRequestError naming the field) and may adjust
   its resolved params; `acquire` takes what the request holds until it ends (a LoRA slot);
   `start` attaches per-sequence host state (`seq.ext[name]`, or a typed slot it owns);
2. scheduling: `runs_tokens` / `run_tokens` take the head of a scheduled chunk into the feature's own
   program (prompt scoring); `drafts_ok` (class flag, checked at admission when `active`) says whether its rows may
   speculate; `needs_newest` says a row's next step needs its newest token on the host (no overlap);
   `holds_drafts` stops drafting for one step;
3. step inputs: `masks` fills allowed-token bitmasks for the batch's rows; `row` adds to a row's
   sampling fields (bias, DRY slots, mirostat state); `step_extras` adds launch inputs (CFG's rows);
   `token_extras` adds per-token-row launch inputs for the step's T rows (images: each row's pool row), and may
   fail a sequence whose inputs it cannot make (its request fails after the launch);
4. after a step is read: `accepted` sees each sampled token (may set its kind, attach to its logprobs,
   or raise `EndSequence` to end that sequence with an error);
5. the end: `usage` adds to the request's usage, `release` frees what `acquire` took (every path).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:
    from imp_jax.runtime.config import EngineConfig
    from imp_jax.runtime.core.engine_stats import EngineCounters
    from imp_jax.runtime.kv.kv_blocks import KVBlockPool
    from imp_jax.runtime.request import GenerationRequest, SamplingParams, TokenLogprob
    from imp_jax.runtime.core.request_state import RequestState
    from imp_jax.runtime.scheduling.scheduler import ScheduledChunk, Scheduler
    from imp_jax.runtime.scheduling.sequence import Sequence
    from imp_jax.runtime.execution.step import CompiledStep


class EndSequence(Exception):
    """Raised by `Feature.accepted` to end the sequence with an error event carrying this message."""


@dataclasses.dataclass
class Services:
    """What the engine lends its features: read freely, mutate only what the hook's docstring says."""

    model: Any               # the served model (nnx.Module)
    tokenizer: Any
    vocab_size: int
    max_model_len: int
    config: EngineConfig
    pool: KVBlockPool
    scheduler: Scheduler
    step_fn: CompiledStep
    counters: EngineCounters
    baseline_free_blocks: int
    generation_config: Any = None
    architecture: str = ""
    vision: Any = None       # the model's image side (model/vision/side.py LoadedVision), None: text only


@dataclasses.dataclass
class Accepted:
    """One sampled token as the loop hands it to `Feature.accepted` (after it joined `seq.output_ids`)."""

    token: int
    out: Any                 # the step's host SamplerOutput
    row: int                 # the token's row in it
    kind: str                # runtime/replies/reasoning.py ANSWER / THINK / MARKER (the think feature sets it)
    logprobs: list[TokenLogprob] | None
    raw: dict[int, float] | None = None   # raw logprobs of probed ids (SamplingParams.raw_logprob_ids)
    verified: bool = False   # it came from a verify chunk (speculative drafts), not a plain decode row
    prompt_logprobs: list | None = None   # the request's prompt logprobs, to ride on its first event


class Feature:
    """Base of every decoding feature; see the module docstring for when each hook runs."""

    name: ClassVar[str] = ""
    drafts_ok: ClassVar[bool] = True   # False: an active request of this feature never speculates

    def __init__(self, services: Services):
        self.s = services

    # 0. before admission, on a worker thread (AsyncEngine.generate): must be thread-safe
    def prepare(self, req: GenerationRequest) -> None:
        """Unbounded per-request work done before admission, off the engine thread (compiling a grammar)."""

    # 1. admission
    @classmethod
    def active(cls, req: GenerationRequest, params: SamplingParams) -> bool:
        """Whether the request uses this feature (for `drafts_ok`)."""
        return False

    def check(self, req: GenerationRequest, params: SamplingParams) -> SamplingParams:
        """Validate the request; return its params, adjusted if the feature implies a knob."""
        return params

    def acquire(self, state: RequestState) -> None:
        """Take what the request holds until it ends (released by `release`, on every path)."""

    def start(self, seq: Sequence, state: RequestState) -> None:
        """Attach the sequence's host state."""

    # 2. scheduling
    def needs_newest(self, seq: Sequence) -> bool:
        """The row's next step needs its newest token on the host (the step cannot overlap the read)."""
        return False

    def holds_drafts(self, seq: Sequence) -> bool:
        """Do not draft for this sequence now (e.g. a forced token may come next)."""
        return False

    # 3. step inputs
    def masks(self, rows: list[tuple[int, Sequence]], masks: dict[int, np.ndarray]) -> None:
        """Fill allowed-token bitmasks (u32[ceil(V/32)] as int32) by row for the step's sampling rows."""

    def row(self, seq: Sequence, fields: dict[str, Any], num_output: int) -> None:
        """Add to a sampling row's RowSpec fields (`num_output`: output tokens before the row's token)."""

    def step_extras(self, chunks: list[ScheduledChunk], num_rows: int) -> dict[str, Any]:
        """Extra keyword inputs of the step's launch (CompiledStep.launch)."""
        return {}

    def token_extras(self, chunks: list[ScheduledChunk], num_tokens: int,
                     failed: list[tuple[Sequence, BaseException]]) -> dict[str, Any]:
        """Extra keyword inputs of the launch sized by the step's `num_tokens` rows (chunk i's tokens follow
        chunk i-1's); a sequence whose inputs cannot be made is appended to `failed` with the error."""
        return {}

    def runs_tokens(self, chunk: ScheduledChunk) -> int:
        """How many leading tokens of a scheduled chunk the feature runs through its own program instead of
        the step (prompt scoring); they were scheduled like any, under the step's token budget and blocks."""
        return 0

    def run_tokens(self, seq: Sequence, n: int) -> None:
        """Launch the sequence's next `n` tokens (from `seq.num_computed`) through the feature's program."""

    # 4. after a step is read
    def accepted(self, seq: Sequence, tok: Accepted) -> None:
        """A token the sequence sampled joined its output; raise EndSequence to end it with an error."""

    # 5. the end
    def usage(self, state: RequestState, usage: dict[str, Any]) -> None:
        """Add the request's usage fields (Usage keyword arguments)."""

    def release(self, state: RequestState) -> None:
        """The request ended (finished, cancelled, failed): free what `acquire` took."""
