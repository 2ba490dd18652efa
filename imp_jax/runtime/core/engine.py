"""The engine core: one thread's loop of schedule -> build inputs -> launch -> read -> emit.

It owns the model, the KV cache and every sequence, and never names a decoding feature: features
(runtime/features/) plug in through one protocol. An exception while preparing, running or
post-processing a step fails the requests it touches (`engine_step_failed`) and the loop goes on;
only a device fault (runtime/core/faults.py) reaches the AsyncEngine, which faults the engine. Nothing
here is thread-safe; the AsyncEngine feeds it through queues and runs it on its own thread.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
from jax.sharding import Mesh

from imp_jax.errors import InvalidRequestError, ModelLoadError
from imp_jax.model.formats.loader import LoadedModel
from imp_jax.runtime.core.admission import admit
from imp_jax.runtime.config import EngineConfig
from imp_jax.runtime.core.engine_stats import EngineCounters, engine_stats
from imp_jax.runtime.features import FEATURES, Feature, Services
from imp_jax.runtime.decoding.image_family import family_class, row_unit, text_hidden
from imp_jax.runtime.kv.kv_blocks import KVBlockPool
from imp_jax.runtime.kv.kv_tiers import attach_tiers
from imp_jax.runtime.core.output import OutputStage
from imp_jax.runtime.request import GenerationRequest
from imp_jax.runtime.core.request_state import Emit, RequestState
from imp_jax.runtime.execution.sampling import SamplerOutput
from imp_jax.runtime.scheduling.scheduler import ScheduledChunk, Scheduler
from imp_jax.runtime.scheduling.sequence import Sequence, SeqStatus
from imp_jax.runtime.scheduling.sessions import SessionPins
from imp_jax.runtime.execution.step import CompiledStep, StepShapes, fetch, step_buckets
from imp_jax.runtime.core.step_failures import FaultHook, StepFailures
from imp_jax.runtime.core.step_inputs import StepBuilder, slice_ids


@dataclasses.dataclass
class _Launched:
    """A launched step whose output the host has not read yet."""

    out: SamplerOutput                  # device arrays
    tokens: jax.Array                   # its sampled tokens, padded (CompiledStep.last_tokens): the next step's prev
    chunks: list[ScheduledChunk]
    samples: list[bool]                 # per chunk: the step samples the sequence's next token
    decode_rows: int
    extra_rows: list[int]               # per chunk: its drafts' first sampled row, or -1
    launched_at: float = 0.0            # perf_counter at launch


class EngineCore:
    """Runs requests to completion on a loaded model; `step()` advances every running sequence once."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, kv_cache, num_blocks: int, mesh: Mesh):
        self.loaded, self.config, self.tokenizer = loaded, config, loaded.tokenizer
        self.max_model_len = config.resolved_max_model_len(loaded.config)
        self.pool = KVBlockPool(num_blocks, config.block_size)
        self.baseline_free_blocks, self.kv_pool_floored = self.pool.num_free_blocks, False   # floored: builder.py
        self.sessions = SessionPins(self.pool, config.session_ttl_s, max_blocks=self.baseline_free_blocks // 2)
        self.scheduler = Scheduler(self.pool, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   fair_tenants=config.fair_tenants)
        shapes = StepShapes(max_blocks=-(-self.max_model_len // config.block_size), vocab_size=loaded.config.vocab_size)
        family = family_class(loaded.vision) if loaded.vision is not None else None   # what the step program takes
        self.step_fn = CompiledStep(loaded.model, kv_cache, shapes,
                                    step_buckets(config.max_num_batched_tokens, config.max_num_seqs), mesh,
                                    image_pool_shape(loaded, config), mrope=bool(family and family.mrope),
                                    bidirectional_images=bool(family and family.bidirectional))
        self.tiers = attach_tiers(self, mesh.devices.flat[0].platform)   # the host KV tier, None when off
        self.counters = EngineCounters()
        self.requests: dict[str, RequestState] = {}
        self.services = Services(loaded.model, loaded.tokenizer, loaded.config.vocab_size, self.max_model_len,
                                 config, self.pool, self.scheduler, self.step_fn, self.counters,
                                 self.baseline_free_blocks, loaded.generation_config, loaded.config.architecture,
                                 loaded.vision)
        self.features: list[Feature] = [f(self.services) for f in FEATURES]
        self.by_name = {f.name: f for f in self.features}
        self.scheduler.drafter = self._draft
        self.scheduler.max_draft_batch = config.speculative_max_batch
        self.scheduler.step_sizes = sorted({T for T, _, _ in self.step_fn.buckets})
        self.output = OutputStage(self.services, self.features, self.requests, self.sessions)
        self.num_steps, self._num_launched = 0, 0   # steps read back; launched (each one's sampler key)
        self.async_scheduling = config.async_scheduling_on()
        self._inflight: _Launched | None = None   # asynchronous scheduling: the step launched, not yet read
        self._scheduled_nothing = False           # the last step had no chunks and nothing in flight to read
        self._fetched_at = 0.0    # when the host last read a step (perf_counter)
        self._busy_at = 0.0       # when the device was last known busy with the step in flight
        self.host_seconds = 0.0   # of the step loop's time, the part the device may have waited for the host
        self.loop_seconds = 0.0   # the step loop's wall time (`_run_batch`)
        self.wait_seconds = 0.0   # of it, blocked reading steps: the rest is host work, overlapped or not
        self.failures = StepFailures(self.counters, self.requests, self._end, self.step_fn.leader is not None)
        self.inputs = StepBuilder(self.services, self.features, self.failures.inject)

    @property
    def fault_hook(self) -> FaultHook | None:
        """A test hook, off in production (runtime/core/step_failures.py: stages, what a raise does)."""
        return self.failures.hook

    @fault_hook.setter
    def fault_hook(self, hook: FaultHook | None) -> None:
        self.failures.hook = hook

    @property
    def loras(self):
        """The adapter slots (runtime/scheduling/lora.py), None without --max-loras."""
        return self.by_name["lora"].slots

    # ------------------------------------------------------------------ requests
    def prepare(self, req: GenerationRequest) -> None:
        """The features' work before admission (Feature.prepare): call it off the engine thread."""
        for f in self.features:
            f.prepare(req)

    def add_request(self, req: GenerationRequest, emit: Emit) -> None:
        """Validate and queue `req`; raise InvalidRequestError if it can never run."""
        if req.request_id in self.requests:
            raise InvalidRequestError(f"request id {req.request_id!r} is already running", param="request_id")
        state = admit(self.services, self.features, req, emit)
        self.requests[req.request_id] = state
        self.counters.requests += 1
        for seq in state.seqs:
            self.scheduler.add(seq)

    def _draft(self, seq: Sequence, limit: int) -> list[int]:
        """Scheduler hook: the speculation feature's drafts, unless another feature holds them now."""
        held = any(f.holds_drafts(seq) for f in self.features)
        return self.by_name["speculation"].draft(seq, limit, held)

    def cancel(self, request_id: str) -> None:
        """Finish every sequence of the request as cancelled, freeing its blocks now."""
        state = self.requests.get(request_id)
        if state is None:
            return
        self._emit_deferred()   # the tokens usage will count reach the client first
        self._end(state, "cancelled")

    def _end(self, state: RequestState, reason: str, error: str | None = None, code: str | None = None) -> None:
        """End every open sequence of the request and release what it holds."""
        for seq in state.seqs:
            if seq.status is not SeqStatus.FINISHED:
                self.output.finish(seq, reason, state, error=error, code=code)
        self.output.end_request(state)

    def end_thinking(self, request_id: str) -> str:
        """Force the end of the request's think blocks: "ending", "already_closed", "unknown" or "not_thinking"."""
        if self._inflight is not None and request_id in self.requests:
            try:   # the trackers see every sampled token before forcing
                self._read(self._take_inflight())
            except Exception as e:
                self._fail_step(e)
        state = self.requests.get(request_id)
        seqs = [s for s in state.seqs if s.status is not SeqStatus.FINISHED] if state is not None else []
        return self.by_name["reasoning"].end_thinking(seqs) if seqs else "unknown"

    def load_lora(self, name: str, adapter) -> dict:
        return self.by_name["lora"].load(name, adapter)

    def unload_lora(self, name: str, reply: Callable) -> None:
        self.by_name["lora"].unload(name, reply)

    def keep_lora(self, name: str) -> int | None:
        return self.by_name["lora"].keep(name)

    def expire_sessions(self) -> None:
        if self.sessions:
            self.sessions.expire()

    def close_session(self, session_id: str) -> bool:
        """Release a session's pinned blocks; whether it was open."""
        return self.sessions.close(session_id)

    def fail_all(self, message: str) -> None:
        """End every request with an error (a device fault)."""
        self.output.deferred = []
        self._inflight = None
        for state in list(self.requests.values()):
            self._end(state, "error", error=message)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.output.deferred) or self._inflight is not None

    def waiting_for_reads(self) -> bool:
        """Whether the last step scheduled nothing while disk reads are under way: until a read lands
        (`tiers.wake`) or a command comes, another step would schedule nothing either."""
        return self._scheduled_nothing and self.tiers is not None and self.tiers.reading > 0

    # ---------------------------------------------------------------------- step
    def step(self) -> int:
        """Run one batch; returns the number of sequences whose step was read (0 when idle)."""
        try:
            ran = self._run_batch()
            self.failures.stepped()
            return ran
        except Exception as e:
            self._fail_step(e)
            return 0

    def _fail_step(self, e: BaseException) -> None:
        self._inflight = None
        self.failures.fail_step(e)

    def _run_batch(self) -> int:
        """One step. Synchronous (async_scheduling off): schedule, build, launch, read, advance.

        Asynchronous (on): schedule step N+1 while N runs, as if every row of N continues (the
        scheduler counts N's tokens as `Sequence.pending`), launch N+1 with N's sampled tokens as a
        device input (a pending token's row reads N's output on the device), then read N and advance
        it (tokens, stop checks, text, events) while N+1 runs. A row N ended gets one dropped token
        in N+1. N is read before scheduling instead when a row's next step needs its token on the
        host (`_overlappable`). Returns the number of sequences whose step was read."""
        t0 = time.perf_counter()
        self.expire_sessions()
        ran, waited = 0, 0.0
        if self._inflight is not None and not self._overlappable(self._inflight):
            ran, waited = self._read(self._take_inflight(), defer_text=True)
        prev = self._inflight
        self.failures.scope = prev.chunks if prev is not None else []
        chunks = self.scheduler.schedule()
        self.failures.scope = chunks + self.failures.scope
        chunks = self._run_features_tokens(chunks)
        self._scheduled_nothing = not chunks and prev is None
        if not chunks:
            if prev is not None:
                n, w = self._read(self._take_inflight())
                ran, waited = ran + n, waited + w
            self._emit_deferred()
            self._account(t0, time.perf_counter() - t0 - waited)
            return ran
        inputs = self.inputs.build(chunks, prev is not None)
        idle = prev is not None and prev.out.tokens.is_ready()   # N is done: the device waits for us
        t1 = time.perf_counter()
        self.failures.inject("launch", [c.seq for c in chunks])
        out = self.step_fn.launch(inputs.batch, inputs.sampling, self._num_launched, [c.seq.table for c in chunks],
                                  inputs.follow, prev.tokens if prev else None, **inputs.extras)
        launched = _Launched(out, self.step_fn.last_tokens, chunks, inputs.samples, inputs.decode_rows,
                             inputs.extra_rows, t1)
        self._num_launched += 1
        self._after_launch(launched)
        for seq, e in inputs.failed:   # their rows were built neutral; the requests end now
            self.failures.fail_seq(seq, e, "prepare")
        if prev is not None:
            self.counters.overlapped_steps += 1
            # host time on the critical path: at most since the device was last known busy
            host = t1 - self._busy_at if idle else 0.0
            self._inflight = None
            n, _ = self._read(prev, also=launched)   # waits for N (device time); its advance overlaps N+1
            self._emit_deferred()
            self._inflight = launched
            self._busy_at = time.perf_counter() if not launched.out.tokens.is_ready() else self._fetched_at
            self._account(t0, host)
            return ran + n
        host = (t1 - t0) - waited   # nothing ran while this step was prepared
        if self.async_scheduling:
            self._inflight = launched
            self._busy_at = t1
            self._emit_deferred()   # the text of a step read above, while this one runs
            self._account(t0, host)
            return ran
        self._emit_deferred()   # the last step's text, while the device runs this one
        n, _ = self._read(launched, defer_text=True)
        self._account(t0, host + time.perf_counter() - self._fetched_at)
        return ran + n

    def _account(self, t0: float, host: float) -> None:
        self.host_seconds += host
        self.loop_seconds += time.perf_counter() - t0

    @property
    def device_seconds(self) -> float:
        """The step loop's time the host was not on the critical path (waiting for, or overlapping, steps)."""
        return self.loop_seconds - self.host_seconds

    def _overlappable(self, launched: _Launched) -> bool:
        """Whether the next step may be scheduled and launched before `launched` is read: asynchronous
        scheduling is on, and no row it samples needs its token on the
        host first (a verify chunk, or a live row a feature says follows its newest token)."""
        if not self.async_scheduling or self.step_fn.leader is not None:
            return False
        for c, samples in zip(launched.chunks, launched.samples):
            if c.drafts:
                return False
            if samples and c.seq.status is not SeqStatus.FINISHED and any(
                    f.needs_newest(c.seq) for f in self.features):
                return False
        return True

    def _run_features_tokens(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """Launch the chunk heads a feature runs through its own program (Feature.runs_tokens: prompt scoring);
        the step keeps the rest."""
        kept = []
        for c in chunks:
            for f in self.features:
                n = f.runs_tokens(c)
                if n:
                    f.run_tokens(c.seq, n)
                    c.seq.num_computed += n
                    self.pool.commit(c.seq.table, slice_ids(c.seq, 0, c.seq.num_computed), c.seq.cache_key)
                    c = ScheduledChunk(c.seq, c.num_tokens - n, c.drafts)
                    break
            if c.num_tokens:
                kept.append(c)
        return kept

    def _take_inflight(self) -> _Launched:
        launched, self._inflight = self._inflight, None
        return launched

    def _after_launch(self, launched: _Launched) -> None:
        """The launched chunks' KV counts as written (later steps run after it on the device): the
        scheduler moves on, and blocks made full by known tokens join the prefix cache now."""
        for i, (c, samples) in enumerate(zip(launched.chunks, launched.samples)):
            seq = c.seq
            seq.num_computed += c.num_tokens
            # a prefill chunk: siblings may look its blocks up next (a verify chunk's drafts are not known tokens)
            if (c.num_tokens > 1 or not samples) and not c.drafts:
                self.pool.commit(seq.table, slice_ids(seq, 0, seq.num_computed), seq.cache_key)
            if samples:
                seq.pending += 1
                seq.pending_row = i

    def _read(self, launched: _Launched, defer_text: bool = False, also: _Launched | None = None
              ) -> tuple[int, float]:
        """`_complete` with a whole-step failure's scope: the read step's requests, and `also`'s (launched after
        it on its tokens)."""
        self.failures.scope = launched.chunks + (also.chunks if also is not None else [])
        result = self._complete(launched, defer_text)
        self.failures.scope = []
        return result

    def _complete(self, launched: _Launched, defer_text: bool = False) -> tuple[int, float]:
        """Read a launched step and advance its sequences; (sequences, seconds waited for it)."""
        t = time.perf_counter()
        self.failures.inject("read", [c.seq for c in launched.chunks])
        out = fetch(launched.out)
        self._fetched_at = time.perf_counter()
        self.wait_seconds += self._fetched_at - t
        self.num_steps += 1
        # counted before the tokens go out: a client that reads /metrics after its last token sees this step
        self.counters.count_step(launched.decode_rows)
        if any(e >= 0 for e in launched.extra_rows):
            self.counters.spec_verify_steps += 1
            self.counters.spec_verify_seconds += self._fetched_at - launched.launched_at
        spec = self.by_name["speculation"]
        for i, (c, samples) in enumerate(zip(launched.chunks, launched.samples)):
            if c.drafts:
                self._emit_deferred()   # earlier tokens' text first: the verified ones are emitted now, in order
                advance = lambda seq, row, first: self.output.advance(seq, True, out, row, first=first, defer=False,
                                                                      verified=True)
                self.failures.guard("advance", c.seq, lambda c=c, i=i, a=advance: spec.verify(c, out, i, launched.extra_rows[i], a))
            else:
                self.failures.guard("advance", c.seq, lambda c=c, i=i, s=samples: self.output.advance(c.seq, s, out, i))
        self.counters.kv_blocks_reserved = self.scheduler.reserved_blocks()
        if not defer_text:
            self._emit_deferred()
        return len(launched.chunks), self._fetched_at - t

    def _emit_deferred(self) -> None:
        """The deferred text events, each sequence's host work guarded on its own."""
        deferred, self.output.deferred = self.output.deferred, []
        for seq, token, logprobs, state, kind, raw in deferred:
            if seq.status is not SeqStatus.FINISHED:
                self.failures.guard("emit", seq, lambda: self.output.emit_token(seq, token, logprobs, state, kind, raw))

    def stats(self) -> dict[str, int | float]:
        """Counters and sizes, safe to read from another thread (runtime/core/engine_stats.py)."""
        return engine_stats(self)


def image_pool_shape(loaded: LoadedModel, config: EngineConfig) -> tuple[int, int] | None:
    """The image row pool's (rows, hidden) for a model with vision (whole units of --image-cache-rows: frames
    for Idefics3, runtime/decoding/image_family.py), else None."""
    if loaded.vision is None:
        return None
    unit = row_unit(loaded.vision)
    if config.image_cache_rows < unit:
        raise ModelLoadError(f"--image-cache-rows {config.image_cache_rows} holds no image unit "
                             f"({unit} rows each)")
    return config.image_cache_rows // unit * unit, text_hidden(loaded.vision)
