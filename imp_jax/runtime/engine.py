"""The engine core: one thread's loop of schedule -> build batch -> step -> emit events.

It owns the model, the KV cache and every sequence. Nothing here is thread-safe; the
AsyncEngine feeds it through queues and runs it on its own thread.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

import jax
import numpy as np
from jax.sharding import Mesh

from imp_jax.errors import InvalidRequestError
from imp_jax.model.detokenizer import IncrementalDetokenizer
from imp_jax.model.loader import LoadedModel
from imp_jax.runtime.banned import REGEX_SPENT, REGEX_SPENT_EXTRA, BannedFilter, BannedPhrases, RewindBudget
from imp_jax.runtime.batch import SeqChunk, build_step_batch
from imp_jax.runtime import cfg as guidance
from imp_jax.runtime.config import EngineConfig
from imp_jax.runtime.constraints import GrammarConstraints
from imp_jax.runtime import mirostat
from imp_jax.runtime.defaults import resolve_params
from imp_jax.runtime.dry import BreakerTable, DryState, top_slots
from imp_jax.runtime.harmony import HarmonyMarkers
from imp_jax.runtime.kv_blocks import KVBlockPool, OutOfBlocks
from imp_jax.runtime.logit_lens import lens_batch, lens_layers
from imp_jax.runtime.lora import AdapterSlots, LoadedAdapter
from imp_jax.runtime.prompt_logprobs import PromptScoring
from imp_jax.runtime.reasoning import ANSWER, THINK, ThinkMarkers
from imp_jax.runtime.request import (EngineEvent, GenerationRequest, SamplingParams, TokenLogprob, Usage,
                                     check_context)
from imp_jax.runtime.sampling import RowSpec, SamplerOutput, build_sampling_tensors, pack_allowed_tokens
from imp_jax.runtime.scheduler import ScheduledChunk, Scheduler
from imp_jax.runtime.sequence import Sequence, SeqStatus
from imp_jax.runtime.sessions import SessionPins
from imp_jax.runtime.speculative import MAX_DRAFT, SpecState, accepted_prefix, ngram_draft, speculation_allowed
from imp_jax.runtime.step import CompiledStep, StepShapes, fetch, step_buckets
from imp_jax.runtime.stop import StopStringMatcher

log = logging.getLogger("imp_jax.engine")
Emit = Callable[[EngineEvent], None]


@dataclasses.dataclass
class EngineCounters:
    """Plain ints the engine thread bumps and `stats()` reads from any thread (no lock: an int is read whole)."""

    requests: int = 0                # requests admitted (add_request passed)
    kv_pressure_rejections: int = 0  # requests refused or ended early because the pool could not hold them
    decode_steps: int = 0            # steps that ran at least one decode row
    decode_rows: int = 0             # decode rows over those steps
    decode_rows_last: int = 0        # decode rows of the most recent such step
    decode_rows_max: int = 0
    kv_blocks_reserved: int = 0      # blocks promised to running sequences, as of the last step
    mask_steps: int = 0              # steps with at least one grammar-constrained row
    mask_rows: int = 0               # constrained rows over those steps
    mask_seconds: float = 0.0        # host time computing their allowed-token masks (before each launch)
    overlapped_steps: int = 0        # steps launched before the previous step was read (async scheduling)
    banned_rewinds: int = 0          # banned_strings / banned_regex rewinds (a completed phrase resampled)
    spec_drafted: int = 0            # speculative decoding (runtime/speculative.py): drafts verified
    spec_accepted: int = 0           # of them, accepted
    spec_emitted: int = 0            # tokens verify rows emitted (accepted drafts + the token after them)
    spec_verify_rows: int = 0        # verify rows (one sequence's drafts in one step)
    spec_miss_rows: int = 0          # of them, accepting nothing
    spec_verify_steps: int = 0       # steps with at least one verify row
    spec_verify_seconds: float = 0.0  # their wall time, launch to read


@dataclasses.dataclass
class _Launched:
    """A launched step whose output the host has not read yet."""

    out: SamplerOutput                  # device arrays
    tokens: jax.Array                   # its sampled tokens, padded (CompiledStep.last_tokens): the next step's prev
    chunks: list[ScheduledChunk]
    samples: list[bool]                 # per chunk: the step samples the sequence's next token
    decode_rows: int
    extra_rows: list[int] = dataclasses.field(default_factory=list)  # per chunk: its drafts' first sampled row
    launched_at: float = 0.0            # perf_counter at launch


@dataclasses.dataclass
class _RequestState:
    request: GenerationRequest
    seqs: list[Sequence]
    emit: Emit
    num_open: int
    prompt_logprobs: list | None = None   # sent once, on index 0's first event
    scoring: PromptScoring | None = None  # the prompt being scored; its sequences wait for it
    adapter: LoadedAdapter | None = None  # its LoRA adapter, held until the request ends


class EngineCore:
    """Runs requests to completion on a loaded model; `step()` advances every running sequence once."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, kv_cache, num_blocks: int, mesh: Mesh):
        self.loaded = loaded
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = config.resolved_max_model_len(loaded.config)
        self.pool = KVBlockPool(num_blocks, config.block_size)
        self.baseline_free_blocks = self.pool.num_free_blocks
        self.sessions = SessionPins(self.pool, config.session_ttl_s, max_blocks=self.baseline_free_blocks // 2)
        self.scheduler = Scheduler(self.pool, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens)
        self.scheduler.drafter = self._draft
        max_blocks = -(-self.max_model_len // config.block_size)
        shapes = StepShapes(max_blocks=max_blocks, vocab_size=loaded.config.vocab_size)
        self.step_fn = CompiledStep(loaded.model, kv_cache, shapes,
                                    step_buckets(config.max_num_batched_tokens, config.max_num_seqs), mesh)
        self.requests: dict[str, _RequestState] = {}
        slabs = getattr(loaded.model, "lora", None)
        self.loras = (AdapterSlots(loaded.model, slabs.options, self.step_fn.write_params)
                      if slabs is not None else None)   # None: started without --max-loras
        self.constraints = GrammarConstraints.for_tokenizer(loaded.tokenizer, loaded.config.vocab_size)
        self.dry_breakers = BreakerTable(loaded.tokenizer, loaded.config.vocab_size)
        # how the model's replies split into reasoning and answer (None: they do not)
        self.think_markers = HarmonyMarkers.from_tokenizer(loaded.tokenizer) or ThinkMarkers.from_tokenizer(
            loaded.tokenizer)
        self._deferred: list[tuple[Sequence, int, list[TokenLogprob] | None, _RequestState, str,
                                   dict[int, float] | None]] = []
        self._scoring: list[_RequestState] = []   # prompt_logprobs requests, oldest first
        self.num_steps = 0        # steps read back
        self._num_launched = 0    # steps launched (each one's sampler key)
        self.async_scheduling = config.async_scheduling == "on"
        self._inflight: _Launched | None = None   # asynchronous scheduling: the step launched, not yet read
        self._fetched_at = 0.0    # when the host last read a step (perf_counter)
        self._busy_at = 0.0       # when the device was last known busy with the step in flight
        self.counters = EngineCounters()
        self.host_seconds = 0.0   # of the step loop's time, the part the device may have waited for the host
        self.loop_seconds = 0.0   # the step loop's wall time (`_run_batch`)
        self.wait_seconds = 0.0   # of it, blocked reading steps: the rest is host work, overlapped or not

    # ------------------------------------------------------------------ requests
    def add_request(self, req: GenerationRequest, emit: Emit) -> None:
        """Validate and queue `req`; raise InvalidRequestError if it can never run."""
        if req.request_id in self.requests:
            raise InvalidRequestError(f"request id {req.request_id!r} is already running", param="request_id")
        vocab = self.loaded.config.vocab_size
        req.params.validate(vocab)
        n_prompt = len(req.prompt_ids)
        params = resolve_params(req.params, self.loaded.generation_config, self.loaded.config.architecture)
        check_context(n_prompt, params.max_tokens, self.max_model_len, "prompt")
        if any(not 0 <= t < vocab for t in req.prompt_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        if self.pool.num_blocks_for(n_prompt + 1) > self.baseline_free_blocks:
            self.counters.kv_pressure_rejections += 1
            raise InvalidRequestError(
                f"the prompt needs {self.pool.num_blocks_for(n_prompt + 1)} KV blocks but the pool has only "
                f"{self.baseline_free_blocks}; raise --num-kv-blocks or --kv-cache-memory",
                code="context_length_exceeded")
        room = self.max_model_len - n_prompt
        if len(self._logit_bias(params, 0)) > self.step_fn.shapes.max_bias:
            raise InvalidRequestError(
                f"at most {self.step_fn.shapes.max_bias} logit_bias entries (stop_token_ids and EOS count "
                f"while min_tokens are out)", param="logit_bias")
        max_tokens = params.max_tokens or room
        params = self._check_lens(params)
        guidance.check_request(req, max_tokens, self.max_model_len, vocab, self.pool, self.baseline_free_blocks)
        if req.lora is not None and self.loras is None:
            raise InvalidRequestError(f"no LoRA adapter named '{req.lora}' is loaded (this server has no adapter "
                                      "slots: --max-loras 0)", code="lora_not_loaded", param="lora")
        phrases = self._check_banned(req, params)
        budget = RewindBudget()
        matchers = [self.constraints.matcher(req.constraint, req.compiled_constraint) if req.constraint else None
                    for _ in range(params.n)]
        adapter = self.loras.acquire(req.lora) if req.lora is not None else None
        scoring = None
        if params.prompt_logprobs is not None:
            try:
                scoring = PromptScoring.begin(self.pool, req.prompt_ids, params.prompt_logprobs,
                                              adapter.slot if adapter else 0)
            except BaseException:
                if adapter is not None:
                    self.loras.release(adapter)
                raise
        seqs: list[Sequence] = []
        think = self.think_markers if req.reasoning else None
        for i in range(params.n):
            p = params if params.seed is None else dataclasses.replace(params, seed=params.seed + i)
            seq = Sequence(
                request=req, index=i, params=p, max_tokens=max_tokens,
                detok=IncrementalDetokenizer(self.tokenizer, skip_special_tokens=p.skip_special_tokens),
                stops=StopStringMatcher(p.stop, p.include_stop_str_in_output),
                prompt_ids=list(req.prompt_ids), parent=seqs[0] if seqs else None, constraint=matchers[i],
                reasoning=think.tracker(req.prompt_ids, req.reasoning_budget) if think else None,
                lora_slot=adapter.slot if adapter else 0, lora_key=adapter.cache_key if adapter else None)
            if req.cfg_scale != 1:
                guidance.attach_shadow(seq, req.cfg_prompt_ids)
            if phrases is not None:
                seq.banned = BannedFilter(phrases, budget)
            seq.spec = self._spec_state(req, p)
            seq.mirostat_mu = mirostat.initial_mu(p.mirostat_tau)
            seqs.append(seq)
        state = _RequestState(req, seqs, emit, len(seqs), scoring=scoring, adapter=adapter)
        self.requests[req.request_id] = state
        self.counters.requests += 1
        if scoring is None:
            for seq in seqs:
                self.scheduler.add(seq)
        else:
            self._scoring.append(state)

    def _spec_state(self, req: GenerationRequest, params: SamplingParams) -> SpecState | None:
        """A sequence's drafting state when the request may speculate (runtime/speculative.py): the
        request's `speculative` or else --speculative, at its n-gram depth or --speculative-max-draft,
        capped so a verify chunk fits a step's sampled rows."""
        on = req.speculative if req.speculative is not None else self.config.speculative == "on"
        depth = req.spec_ngram_k if req.spec_ngram_k is not None else self.config.speculative_max_draft
        depth = min(depth, MAX_DRAFT, self.config.max_num_seqs - 1, self.config.max_num_batched_tokens - 1)
        if not on or depth <= 0 or not speculation_allowed(params, req) or self.step_fn.leader is not None:
            return None
        return SpecState(max_k=depth)

    def _draft(self, seq: Sequence, limit: int) -> list[int]:
        """Scheduler hook: up to `limit` drafts for a decoding sequence (none while a think budget may
        force its next token, or past max_tokens and the context)."""
        spec = seq.spec
        if spec is None or seq.status is not SeqStatus.RUNNING:
            return []
        if seq.reasoning is not None and (seq.reasoning.may_force or seq.reasoning.forced_token is not None):
            return []
        room = min(limit, seq.max_tokens - len(seq.output_ids) - 1, self.max_model_len - seq.num_tokens - 1)
        k = spec.depth()
        if k <= 0 or room <= 0:
            return []
        # a chunk of 1 + k tokens runs padded to a power of two: drafts that fill the padding cost nothing
        # more (alone in its step) and may be accepted
        return ngram_draft(seq.all_ids, min(2 ** (k + 1).bit_length() - 1 if k & (k + 1) else k, room, spec.max_k))

    def cancel(self, request_id: str) -> None:
        """Finish every sequence of the request as cancelled, freeing its blocks now."""
        state = self.requests.get(request_id)
        if state is None:
            return
        self._emit_deferred()   # the tokens usage will count reach the client first
        self._stop_scoring(state)
        for seq in state.seqs:
            if seq.status is not SeqStatus.FINISHED:
                self._finish(seq, "cancelled", state)

    def end_thinking(self, request_id: str) -> str:
        """Force the end of the request's think blocks: "ending", "already_closed", "unknown" or "not_thinking"."""
        if self._inflight is not None and request_id in self.requests:
            self._complete(self._take_inflight())   # the trackers see every sampled token before forcing
        state = self.requests.get(request_id)
        if state is None:
            return "unknown"
        trackers = [s.reasoning for s in state.seqs if s.status is not SeqStatus.FINISHED]
        if not trackers or any(t is None for t in trackers):
            return "not_thinking" if trackers else "unknown"
        answers = [t.force_end() for t in trackers]
        return "ending" if "ending" in answers else "already_closed"

    @staticmethod
    def _check_banned(req: GenerationRequest, params: SamplingParams) -> BannedPhrases | None:
        """The request's banned phrases (None without any); 400 with what a rewind cannot undo or follow:
        an output constraint, mirostat, classifier-free guidance, raw logprob probes."""
        if not (params.banned_strings or params.banned_regex):
            return None
        field = "banned_strings" if params.banned_strings else "banned_regex"
        clash = ("structured output or enforced tool calls" if req.constraint else
                 "'mirostat'" if params.mirostat else
                 "'cfg_scale'" if req.cfg_scale != 1 else
                 "raw logprob probes (/v1/score, /v1/decide)" if params.raw_logprob_ids else None)
        if clash is not None:
            raise InvalidRequestError(f"'{field}' cannot be combined with {clash}", param=field)
        return BannedPhrases(params.banned_strings, params.banned_regex)

    # --------------------------------------------------------------------- LoRA
    def load_lora(self, name: str, adapter) -> dict:
        """Put a read adapter (AdapterSlots.read) in a free slot; 400 when the server has no slots."""
        if self.loras is None:
            raise InvalidRequestError("this server has no LoRA adapter slots; start it with --max-loras N",
                                      code="lora_disabled", param="name")
        return self.loras.load(name, adapter).describe()

    def unload_lora(self, name: str, reply: Callable) -> None:
        """Free `name`'s slot once the requests using it end; `reply` gets its description, or None."""
        if self.loras is None:
            reply(None)
        else:
            self.loras.unload(name, reply)

    def keep_lora(self, name: str) -> int | None:
        """Call off `name`'s pending unload (runtime/lora.py AdapterSlots.keep)."""
        return self.loras.keep(name) if self.loras is not None else None

    def expire_sessions(self) -> None:
        if self.sessions:
            self.sessions.expire()

    def close_session(self, session_id: str) -> bool:
        """Release a session's pinned blocks; whether it was open."""
        return self.sessions.close(session_id)

    def fail_all(self, message: str) -> None:
        """End every request with an error (a device fault)."""
        self._deferred = []
        self._inflight = None
        for state in list(self._scoring):
            self._stop_scoring(state)
        for rid in list(self.requests):
            state = self.requests[rid]
            for seq in state.seqs:
                if seq.status is not SeqStatus.FINISHED:
                    self._finish(seq, "error", state, error=message)

    def has_work(self) -> bool:
        return (self.scheduler.has_work() or bool(self._deferred) or bool(self._scoring)
                or self._inflight is not None)

    def _score_one_chunk(self) -> int:
        """One chunk of the oldest prompt being scored; a scored prompt's sequences join the scheduler."""
        if not self._scoring:
            return 0
        state = self._scoring[0]
        state.scoring.run_chunk(self.step_fn, self.config.block_size)
        if state.scoring.done:
            state.prompt_logprobs = state.scoring.entries
            self._stop_scoring(state)
            for seq in state.seqs:
                self.scheduler.add(seq)
        return 1

    def _stop_scoring(self, state: _RequestState) -> None:
        if state.scoring is not None:
            state.scoring.release(self.pool)
            state.scoring = None
            self._scoring.remove(state)

    # ---------------------------------------------------------------------- step
    def step(self) -> int:
        """Run one batch, then one chunk of a prompt being scored (prompt_logprobs), if any;
        returns the number of sequences that ran (0 when idle)."""
        return self._run_batch() + self._score_one_chunk()

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
            ran, waited = self._complete(self._take_inflight(), defer_text=True)
        prev = self._inflight
        chunks = self.scheduler.schedule()
        if not chunks:
            if prev is not None:
                n, w = self._complete(self._take_inflight())
                ran, waited = ran + n, waited + w
            self._emit_deferred()
            self._account(t0, time.perf_counter() - t0 - waited)
            return ran
        batch, sampling, follow, samples, decode_rows, extra_rows = self._build(chunks, prev)
        idle = prev is not None and prev.out.tokens.is_ready()   # N is done: the device waits for us
        t1 = time.perf_counter()
        out = self.step_fn.launch(batch, sampling, self._num_launched, [c.seq.table for c in chunks],
                                  follow, prev.tokens if prev else None,
                                  cfg=guidance.step_inputs(chunks, len(batch.seq_lens)))
        launched = _Launched(out, self.step_fn.last_tokens, chunks, samples, decode_rows, extra_rows, t1)
        self._num_launched += 1
        self._after_launch(launched)
        if prev is not None:
            self.counters.overlapped_steps += 1
            # host time on the critical path: at most since the device was last known busy
            host = t1 - self._busy_at if idle else 0.0
            self._inflight = None
            n, _ = self._complete(prev)   # waits for N (device time); its advance overlaps N+1
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
        n, _ = self._complete(launched, defer_text=True)
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
        scheduling is on, no row it samples needs its token on the host first, and no prompt is being
        scored (prompt_logprobs)."""
        if not self.async_scheduling or self._scoring or self.step_fn.leader is not None:
            return False
        # drafting reads the newest token; it needs sampled rows to spare (a full batch has none)
        rows_spare = len(self.scheduler.running) + len(self.scheduler.waiting) < self.config.max_num_seqs
        for c, samples in zip(launched.chunks, launched.samples):
            seq = c.seq
            if c.drafts or (samples and rows_spare and self._may_draft(seq)):
                return False
            if not samples:
                continue
            # logit_lens runs its program after the read; a CFG shadow is fed its main's token on the host
            if seq.params.logit_lens is not None or seq.shadow is not None or seq.main is not None:
                return False
            # a live row whose next step follows its newest token: a grammar's or a forced think end's mask,
            # a banned phrase's rewind, DRY's penalties (the whole history), mirostat's next mu
            if seq.status is not SeqStatus.FINISHED and (
                    seq.constraint is not None or (seq.reasoning is not None and seq.reasoning.may_force)
                    or seq.banned is not None or seq.params.dry.on or seq.params.mirostat):
                return False
        return True

    def _may_draft(self, seq: Sequence) -> bool:
        """Whether the sequence would draft at its next step (its known tokens end in an n-gram seen
        before): then that step waits for its newest token instead of overlapping."""
        spec = seq.spec
        return (spec is not None and spec.depth() > 0 and seq.status is SeqStatus.RUNNING
                and bool(ngram_draft(seq.all_ids, 1)))

    def _take_inflight(self) -> _Launched:
        launched, self._inflight = self._inflight, None
        return launched

    def _build(self, chunks: list[ScheduledChunk], prev: _Launched | None):
        """The step's batch and sampling tensors; a pending token (sampled by `prev`, not read yet) gets
        id 0 here and `follow` points its row at prev's output row (and a penalised row's history slot).

        Chunk i samples row i (at its last token; a verify chunk's at its newest known token); a verify
        chunk's drafts sample rows after every chunk's, from `extra_rows[i]` on, each seeing the drafts
        before it (runtime/speculative.py)."""
        bs = self.config.block_size
        num_drafts = sum(len(c.drafts) for c in chunks)
        T, S = self.step_fn.bucket_for(sum(c.num_tokens for c in chunks), len(chunks) + num_drafts)
        src = np.full(T, -1, np.int32)
        hist_pos = np.full(S, -1, np.int32)
        seq_chunks, rows, samples, extra_rows, extra_specs = [], [], [], [], []
        masks = self._masks(chunks)
        H = self.step_fn.shapes.history_len
        t = decode_rows = 0
        for i, c in enumerate(chunks):
            seq = c.seq
            ids = _slice_ids(seq, seq.num_computed, c.num_tokens - len(c.drafts))
            missing = c.num_tokens - len(c.drafts) - len(ids)   # the newest token, sampled by prev, not read yet
            if missing:
                if missing != 1 or prev is None or seq.pending != 1:
                    raise RuntimeError(f"sequence {seq.seq_id}: {missing} unknown tokens scheduled")
                ids = ids + [0]
                src[t + c.num_tokens - 1] = seq.pending_row
            if c.drafts:
                extra_rows.append(len(chunks) + len(extra_specs))
                extra_specs += [self._row_spec(seq, None, ahead=c.drafts[:j + 1]) for j in range(len(c.drafts))]
                ids = ids + list(c.drafts)
            else:
                extra_rows.append(-1)
            seq_chunks.append(SeqChunk(ids, seq.num_computed, seq.table.block_ids, seq.lora_slot))
            samples.append(c.samples)
            if not c.samples or seq.main is not None:   # a CFG shadow's row only lends its logits
                rows.append(RowSpec(temperature=0.0))
            else:
                row = self._row_spec(seq, masks.get(i), pending=missing)
                if missing and row.history:
                    hist_pos[i] = len(row.history) - 1
                rows.append(row)
            decode_rows += not seq.is_prefill
            t += c.num_tokens
        batch = build_step_batch(seq_chunks, num_tokens=T, num_seqs=S,
                                 max_blocks=self.step_fn.shapes.max_blocks, block_size=bs, with_tables=False)
        for i, c in enumerate(chunks):
            if c.drafts:   # row i verifies the first draft at the newest known token; the rest follow
                start = int(batch.query_start_loc[i])
                batch.last_token_rows[i] = start
                e = extra_rows[i]
                batch.last_token_rows[e:e + len(c.drafts)] = np.arange(start + 1, start + 1 + len(c.drafts))
        shapes = self.step_fn.shapes
        sampling = build_sampling_tensors(rows + extra_specs, num_rows_bucket=S, vocab_size=shapes.vocab_size,
                                          history_len=H, max_bias=shapes.max_bias, with_mask=True)
        follow = (src, hist_pos) if prev is not None else None
        return batch, sampling, follow, samples, decode_rows, extra_rows

    def _after_launch(self, launched: _Launched) -> None:
        """The launched chunks' KV counts as written (later steps run after it on the device): the
        scheduler moves on, and blocks made full by known tokens join the prefix cache now."""
        for i, (c, samples) in enumerate(zip(launched.chunks, launched.samples)):
            seq = c.seq
            seq.num_computed += c.num_tokens
            # a prefill chunk: siblings may look its blocks up next (a verify chunk's drafts are not known tokens)
            if (c.num_tokens > 1 or not samples) and not c.drafts:
                self.pool.commit(seq.table, _slice_ids(seq, 0, seq.num_computed), seq.cache_key)
            if samples:
                seq.pending += 1
                seq.pending_row = i

    def _complete(self, launched: _Launched, defer_text: bool = False) -> tuple[int, float]:
        """Read a launched step and advance its sequences; (sequences, seconds waited for it)."""
        t = time.perf_counter()
        out = fetch(launched.out)
        self._fetched_at = time.perf_counter()
        self.wait_seconds += self._fetched_at - t
        self.num_steps += 1
        for i, (c, samples) in enumerate(zip(launched.chunks, launched.samples)):
            if c.drafts:
                self._verify(c, out, i, launched.extra_rows[i])
                continue
            if samples and c.seq.spec is not None:
                c.seq.spec.plain_step()
            self._advance(c.seq, samples, out, i)
        if any(launched.extra_rows[i] >= 0 for i in range(len(launched.chunks))):
            self.counters.spec_verify_steps += 1
            self.counters.spec_verify_seconds += self._fetched_at - launched.launched_at
        self._count_step(launched.decode_rows)
        if not defer_text:
            self._emit_deferred()
        return len(launched.chunks), self._fetched_at - t

    def _verify(self, chunk: ScheduledChunk, out, row: int, extra: int) -> None:
        """A read verify chunk (runtime/speculative.py): accept the drafts that equal the tokens sampled
        at their rows, drop the rest's KV (KVBlockPool.truncate), then emit the accepted drafts and
        the token sampled after them, one by one, as plain steps would have."""
        seq, drafts = chunk.seq, chunk.drafts
        if seq.status is SeqStatus.FINISHED:
            return
        rows = [row, *range(extra, extra + len(drafts))]
        accepted = accepted_prefix(drafts, [int(out.tokens[r]) for r in rows])
        seq.spec.record(len(drafts), accepted)
        c = self.counters
        c.spec_drafted += len(drafts)
        c.spec_accepted += accepted
        c.spec_emitted += accepted + 1
        c.spec_verify_rows += 1
        c.spec_miss_rows += accepted == 0
        seq.num_computed -= len(drafts) - accepted   # the newest token and the accepted drafts keep their KV
        if seq.status is SeqStatus.RUNNING and self.pool.truncate(seq.table, seq.num_computed) is not None:
            raise RuntimeError(f"sequence {seq.seq_id}: a verify chunk wrote into a shared block")
        self._emit_deferred()   # earlier tokens' text first: these are emitted now, in order
        for j in range(accepted + 1):
            self._advance(seq, True, out, rows[j], first=j == 0, defer=False)
            if seq.status is SeqStatus.FINISHED:
                break

    def _count_step(self, decode_rows: int) -> None:
        c = self.counters
        if decode_rows:
            c.decode_steps += 1
            c.decode_rows += decode_rows
            c.decode_rows_last = decode_rows
            c.decode_rows_max = max(c.decode_rows_max, decode_rows)
        c.kv_blocks_reserved = self.scheduler.reserved_blocks()

    def _row_spec(self, seq: Sequence, mask: np.ndarray | None, pending: int = 0,
                  ahead: tuple[int, ...] = ()) -> RowSpec:
        """`pending`: the sequence's newest token is not read yet (its history slot holds 0 here; the
        step fills it on the device). `ahead`: the drafts before this row (a verify row samples as if
        they were output: in its penalties' history, min_tokens count and seeded position)."""
        p = seq.params
        H = self.step_fn.shapes.history_len
        n_out = len(seq.output_ids) + pending + len(ahead)
        history = ()
        if _has_penalty(p):
            known = _slice_ids(seq, max(0, seq.num_known - H + pending + len(ahead)), H)
            history = (known + [0] * pending + list(ahead))[-H:]
        return RowSpec(
            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
            typical_p=p.typical_p, presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty,
            seed=p.seed, position=seq.num_tokens + len(ahead),
            history=history, num_output_tokens=n_out if history else 0,
            logit_bias=self._logit_bias(p, n_out, seq.banned), wants_top_logprobs=p.logprobs is not None,
            allowed_bitmask=mask, dry=self._dry(seq, pending, ahead), mirostat=p.mirostat,
            mirostat_tau=p.mirostat_tau, mirostat_eta=p.mirostat_eta, mirostat_mu=seq.mirostat_mu)

    def _dry(self, seq: Sequence, pending: int, ahead: tuple[int, ...]) -> list[tuple[int, float]]:
        """The row's DRY (token id, penalty) slots from the sequence's DryState, which catches up with the
        tokens accepted or rewound since (dry.py); speculation_allowed keeps DRY rows from drafting and a
        DRY row is never overlapped (`_overlappable`), so its history is all known."""
        d = seq.params.dry
        if not d.on:
            return []
        if pending or ahead:
            raise RuntimeError(f"sequence {seq.seq_id}: a DRY row was scheduled before its newest token was read")
        if seq.dry is None:
            seq.dry = DryState(d, self.dry_breakers.breakers(d.sequence_breakers), self.max_model_len)
        return top_slots(seq.dry.penalties(seq.prompt_ids, seq.output_ids))

    def _masks(self, chunks: list[ScheduledChunk]) -> dict[int, np.ndarray]:
        """Each sampling row's next-token bitmask, by row; a row without one samples any token.

        A forced think end allows its next token only. Otherwise a grammar applies outside a think
        block, with `<think>` allowed too while the block may still open; all grammar rows are filled
        in one call that leaves the GIL and runs them in parallel."""
        masks: dict[int, np.ndarray] = {}
        grammar_rows: list[int] = []
        for i, c in enumerate(chunks):
            if not c.samples:
                continue
            think = c.seq.reasoning
            if think is not None and think.forced_token is not None:
                masks[i] = pack_allowed_tokens([think.forced_token], self.loaded.config.vocab_size)
            elif c.seq.constraint is not None and (think is None or think.constrained):
                grammar_rows.append(i)
        if not grammar_rows:
            return masks
        t0 = time.perf_counter()
        words = np.empty((len(grammar_rows), self.constraints.mask_words), np.int32)
        self.constraints.fill_masks([chunks[i].seq.constraint for i in grammar_rows], words)
        bits = words.view(np.uint32)
        for k, i in enumerate(grammar_rows):
            think = chunks[i].seq.reasoning
            if think is not None and think.may_open:
                start = think.markers.start_id
                bits[k, start // 32] |= np.uint32(1 << (start % 32))
            masks[i] = words[k]
        c = self.counters
        c.mask_steps += 1
        c.mask_rows += len(grammar_rows)
        c.mask_seconds += time.perf_counter() - t0
        return masks

    def _logit_bias(self, p: SamplingParams, num_output: int, phrases: BannedFilter | None = None
                    ) -> dict[int, float]:
        """The request's logit_bias, plus a ban on EOS and stop token ids until min_tokens are out, plus
        a bias of 0 (a probe: the sampler reports its raw logprob) on each raw_logprob_ids entry, in the
        first slots (_advance reads them there), plus the tokens a banned phrase was rewound from at this
        position (as many as the sampler's bias slots leave room for, newest first)."""
        bias = {**dict.fromkeys(p.raw_logprob_ids, 0.0), **p.logit_bias} if p.raw_logprob_ids else p.logit_bias
        if num_output < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.tokenizer.eos_ids))
            bias = {**bias, **dict.fromkeys(banned, float("-inf"))}
        rewound = phrases.bans.get(num_output) if phrases is not None else None
        if rewound:
            room = self.step_fn.shapes.max_bias - len(bias)
            new = [t for t in reversed(rewound) if t not in bias][:max(0, room)]
            bias = {**bias, **dict.fromkeys([t for t in rewound if t in bias] + new, float("-inf"))}
        return bias

    def _advance(self, seq: Sequence, samples: bool, out, row: int, first: bool = True, defer: bool = True) -> None:
        """A read step's row: its sampled token joins the sequence (num_computed moved at launch). A
        sequence preempted since the launch keeps its token (it recomputes its KV when readmitted).
        A verify chunk's later tokens (`first` False) were not counted pending; `defer` False emits
        the token's text now (the next token joins the sequence only after)."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.main is not None:   # a CFG shadow: its main's row feeds it (runtime/cfg.py); it emits nothing
            if seq.status is SeqStatus.RUNNING:
                self.pool.commit(seq.table, seq.all_ids[:seq.num_computed], seq.cache_key)
            return
        state = self.requests[seq.request.request_id]
        token = None
        if samples:
            token = int(out.tokens[row])
            seq.pending -= first
            if seq.params.mirostat:   # never overlapped (_overlappable): this step's mu is the next row's
                seq.mirostat_mu = float(out.mirostat_mu[row])
            seq.output_ids.append(token)
            if seq.shadow is not None:
                guidance.feed(seq.shadow, token)
        if seq.status is SeqStatus.RUNNING:
            # every token with KV written (or being written by a launched step) is known now
            self.pool.commit(seq.table, seq.all_ids[:seq.num_computed], seq.cache_key)
            if seq.request.cache_prompt and not seq.pinned and seq.num_computed >= len(seq.prompt_ids):
                self.pool.pin(seq.table)
                seq.pinned = True
        if not samples:
            return
        raw = None
        if seq.params.raw_logprob_ids:   # the probes fill the first logit_bias slots, in order (_logit_bias)
            raw = {t: float(out.bias_raw_logprobs[row, i])
                   for i, t in enumerate(dict.fromkeys(seq.params.raw_logprob_ids))}
        kind = seq.reasoning.observe(token) if seq.reasoning is not None else ANSWER
        if (seq.constraint is not None and kind == ANSWER and (seq.reasoning is None or seq.reasoning.constrained)
                and not seq.constraint.accept(token)):
            # the grammar allowed no token the request's logit_bias left (the sampler drew from nothing)
            self._finish(seq, "error", state, error=f"the output constraint allowed no token the request's "
                         f"logit_bias permits ({seq.constraint.failed})")
            return
        logprobs = None
        if seq.params.logprobs is not None:
            k = seq.params.logprobs
            top = [(int(t), float(v)) for t, v in zip(out.top_ids[row, :k], out.top_logprobs[row, :k])]
            logprobs = [TokenLogprob(token, float(out.logprob[row]), top)]
            if seq.params.logit_lens is not None and seq.status is SeqStatus.RUNNING:
                logprobs[0].lens = self._lens(seq, token)
        if not defer or self._ends_without_text(seq, token) or seq.banned is not None:   # a rewind lands before the next step
            self._emit_token(seq, token, logprobs, state, kind, raw)
        else:
            self._deferred.append((seq, token, logprobs, state, kind, raw))

    def _check_lens(self, params: SamplingParams) -> SamplingParams:
        """logit_lens needs a model that returns per-layer residuals, one host, and implies logprobs."""
        if params.logit_lens is None:
            return params
        if not self.step_fn.supports_lens or self.step_fn.leader is not None:
            why = ("this model's architecture does not return per-layer residuals" if not self.step_fn.supports_lens
                   else "it does not run multi-host")
            raise InvalidRequestError(f"'logit_lens' is not supported here: {why}", code="not_supported",
                                      param="logit_lens")
        return params if params.logprobs is not None else dataclasses.replace(params, logprobs=0)

    def _lens(self, seq: Sequence, token: int) -> list:
        """logit_lens layers for `token`, just sampled by `seq` (its step read, its KV still held)."""
        batch = lens_batch(seq.all_ids, seq.table.block_ids, seq.lora_slot, self.step_fn.shapes.max_blocks,
                           self.config.block_size)
        return lens_layers(lambda b, t: self.step_fn.lens(b, t, [seq.table]), batch, token, seq.params.logit_lens)

    def _ends_without_text(self, seq: Sequence, token: int) -> bool:
        """Whether `token` ends `seq` for a reason its text plays no part in (EOS, a stop token id,
        max_tokens, a pool too small): then its event goes out now. Any other token's text work
        (detokenizing, stop strings) waits for the next step's launch, so it overlaps that step;
        a stop string found then costs the sequence one token of compute, which is dropped."""
        p = seq.params
        n_out = len(seq.output_ids)
        stops = (token in self.tokenizer.eos_ids and not p.ignore_eos) or token in p.stop_token_ids
        return ((stops and n_out > p.min_tokens) or n_out >= seq.max_tokens
                or guidance.kv_blocks(self.pool, seq) > self.baseline_free_blocks)

    def _emit_deferred(self) -> None:
        """The text events `_advance` deferred, in order; a sequence ended meanwhile (cancelled) has none."""
        deferred, self._deferred = self._deferred, []
        for seq, token, logprobs, state, kind, raw in deferred:
            if seq.status is not SeqStatus.FINISHED:
                self._emit_token(seq, token, logprobs, state, kind, raw)

    def _emit_token(self, seq: Sequence, token: int, logprobs, state: _RequestState, kind: str = ANSWER,
                    raw: dict[int, float] | None = None) -> None:
        """`kind` (runtime/reasoning.py): think text goes to reasoning_text, past stop strings; a marker has no text.
        `raw`: the raw logprobs of the request's raw_logprob_ids where this token was sampled."""
        p = seq.params
        n_out = len(seq.output_ids)
        is_eos = token in self.tokenizer.eos_ids and not p.ignore_eos
        is_stop_id = token in p.stop_token_ids
        filtered = (seq.banned is not None and seq.banned.active and kind == ANSWER
                    and not (is_eos or is_stop_id))
        if seq.banned is not None and seq.banned.holding and not filtered and self._release_held(seq, state):
            return   # the held text ended the sequence on a stop string
        finish, stop_reason, text, reasoning = None, None, "", ""
        ids: list[int] = [token]
        if (is_eos or is_stop_id) and n_out > p.min_tokens:
            finish, stop_reason = "stop", token
        elif kind == THINK:
            reasoning = seq.detok.add([token])
        elif kind != ANSWER:
            reasoning = seq.detok.flush()   # a marker: the block's held-back bytes end with it
        elif not (is_eos or is_stop_id):
            if filtered:
                released = self._filter_banned(seq, token, logprobs)
                if seq.banned.out_of_time:   # its patterns spent the request's regex time
                    seq.finish_reason = "error"
                    self._close(seq, state, EngineEvent(seq.request.request_id, seq.index, finish_reason="error",
                                                        error=REGEX_SPENT, extra=dict(REGEX_SPENT_EXTRA)))
                    return
                if released is None:
                    return   # rewound: the sequence samples this position again
                ids, logprobs, delta = released
            else:
                delta = self._answer_delta(seq, token)
            if n_out <= p.min_tokens:
                text = delta  # stop strings apply once min_tokens are out
            else:
                text, matched = seq.stops.feed(delta)
                if matched is not None:
                    finish, stop_reason = "stop", matched
        # a sequence whose KV would outgrow the whole pool could never be scheduled again
        too_big = guidance.kv_blocks(self.pool, seq) > self.baseline_free_blocks   # with a CFG shadow's
        if finish is None and (n_out >= seq.max_tokens or too_big):
            finish = "length"
            if too_big and n_out < seq.max_tokens:
                self.counters.kv_pressure_rejections += 1
        if finish is not None and not isinstance(stop_reason, str):
            if seq.reasoning is not None and seq.reasoning.thinking:
                reasoning += seq.detok.flush()
            held_text = ""
            if seq.banned is not None:   # the held tokens go out with the sequence's end
                held_ids, held_logprobs, held_text = seq.banned.flush()
                ids = ids + held_ids
                if p.logprobs is not None:
                    logprobs = (logprobs or []) + held_logprobs
            owed = seq.reasoning.finish_text() if seq.reasoning is not None else ""
            tail, matched = seq.stops.feed(held_text + seq.detok.flush() + owed)
            text += tail + ("" if matched else seq.stops.flush())
        if finish is None and not ids:
            return   # every token so far is held back (banned phrases may still complete)
        event = EngineEvent(seq.request.request_id, seq.index, ids, text, reasoning_text=reasoning,
                            logprobs=logprobs, raw_logprobs=raw)
        self._attach_prompt_logprobs(seq, state, event)
        if finish is None:
            self._send(state, event)
            return
        seq.finish_reason = finish
        event.finish_reason, event.stop_reason = finish, stop_reason
        self._close(seq, state, event)

    def _answer_delta(self, seq: Sequence, token: int) -> str:
        delta = seq.detok.add([token])
        return seq.reasoning.answer_text(delta) if seq.reasoning is not None else delta

    def _filter_banned(self, seq: Sequence, token: int, logprobs) -> tuple[list[int], list, str] | None:
        """Hold `token` back with its text until no banned phrase can complete in it; returns the
        (ids, logprobs, text) safe to send now, or None when its text completed a phrase and the sequence
        was rewound to the token the phrase starts in."""
        f = seq.banned
        f.push(len(seq.output_ids) - 1, token, logprobs, seq.detok.snapshot())
        at = f.feed(self._answer_delta(seq, token))
        if at is None:
            ids, held_logprobs, text = f.release()
            return ids, (held_logprobs if logprobs is not None else None), text
        self._rewind(seq, f.rewind(at))
        return None

    def _rewind(self, seq: Sequence, held) -> None:
        """Take the sequence back to just before `held` (the token a banned phrase starts in): its output,
        detokenizer and KV. The token before it is fed again (its KV rewritten, the same values) so the
        next step samples the position anew, with the token banned there (_logit_bias)."""
        self.counters.banned_rewinds += 1
        seq.detok.restore(held.detok)
        del seq.output_ids[held.position:]
        log.debug("banned_rewind request=%s index=%d position=%d token=%d rewinds_left=%d",
                  seq.request.request_id, seq.index, held.position, held.token, seq.banned.budget.left)
        if seq.status is not SeqStatus.RUNNING:
            return   # preempted: it recomputes its KV from the shortened output when readmitted
        keep = len(seq.prompt_ids) + held.position - 1
        try:
            copy = self.pool.truncate(seq.table, keep)
        except OutOfBlocks:
            self.scheduler.preempt(seq)
            return
        # a shared tail block was swapped for a fresh one: recompute its tokens rather than copy it on device
        seq.num_computed = keep if copy is None else keep - keep % self.config.block_size

    def _release_held(self, seq: Sequence, state: _RequestState) -> bool:
        """Send the held tokens (a token without answer text follows, or phrases stopped applying);
        whether their text completed a stop string, which ends the sequence."""
        ids, logprobs, delta = seq.banned.flush()
        text, matched = (delta, None) if len(seq.output_ids) <= seq.params.min_tokens else seq.stops.feed(delta)
        event = EngineEvent(seq.request.request_id, seq.index, ids, text,
                            logprobs=logprobs if seq.params.logprobs is not None else None)
        self._attach_prompt_logprobs(seq, state, event)
        if matched is None:
            self._send(state, event)
            return False
        seq.finish_reason = event.finish_reason = "stop"
        event.stop_reason = matched
        self._close(seq, state, event)
        return True

    @staticmethod
    def _attach_prompt_logprobs(seq: Sequence, state: _RequestState, event: EngineEvent) -> None:
        """The request's prompt logprobs ride on its first sequence's first event."""
        if seq.index == 0 and state.prompt_logprobs is not None:
            event.prompt_logprobs, state.prompt_logprobs = state.prompt_logprobs, None

    def _finish(self, seq: Sequence, reason: str, state: _RequestState, error: str | None = None) -> None:
        seq.finish_reason = reason
        self._close(seq, state, EngineEvent(seq.request.request_id, seq.index, finish_reason=reason, error=error))

    def _close(self, seq: Sequence, state: _RequestState, event: EngineEvent) -> None:
        """Free the sequence (a session's first choice leaves its blocks pinned for the next turn);
        the request's last sequence carries usage and done=True."""
        if seq.request.session_id and seq.index == 0 and event.finish_reason != "error":
            self.sessions.keep(seq.request.session_id, seq.table)
        self.scheduler.remove(seq)
        state.num_open -= 1
        if state.num_open == 0:
            first = state.seqs[0]
            event.usage = Usage(prompt_tokens=len(first.prompt_ids),
                                completion_tokens=sum(len(s.output_ids) for s in state.seqs),
                                cached_tokens=first.cached_prompt_tokens or 0,
                                reasoning_tokens=sum(s.reasoning.num_reasoning_tokens for s in state.seqs
                                                     if s.reasoning is not None),
                                spec=self._spec_usage(state))
            event.done = True
            del self.requests[seq.request.request_id]
            if state.adapter is not None:
                self.loras.release(state.adapter)
        self._send(state, event)

    @staticmethod
    def _spec_usage(state: _RequestState) -> dict | None:
        """The request's imp_spec_* usage: its choices' verify counters when a verify step ran, and a
        decline when it asked for an MTP head (this server has none)."""
        specs = [s.spec for s in state.seqs if s.spec is not None]
        usage: dict = {}
        if any(sp.verify_steps for sp in specs):
            usage = {key: sum(sp.usage()[key] for sp in specs) for key in specs[0].usage()}
        if state.request.spec_mtp_k:
            usage = {"imp_spec_drafted": 0, "imp_spec_accepted": 0, "imp_spec_emitted": 0,
                     "imp_spec_verify_steps": 0, **usage,
                     "imp_spec_declined": 1, "imp_spec_declined_detail": "no_mtp_head"}
        return usage or None

    @staticmethod
    def _send(state: _RequestState, event: EngineEvent) -> None:
        event.admitted_at = state.seqs[0].first_scheduled_at
        state.emit(event)

    def stats(self) -> dict[str, int | float]:
        """Counters and sizes, safe to read from another thread (plain ints; live gauges read 0 when idle)."""
        pc = self.pool.stats()
        c = self.counters
        busy = bool(self.requests)
        free = self.pool.num_free_blocks
        return dict(num_free_blocks=free, baseline_free_blocks=self.baseline_free_blocks,
                    num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                    num_preemptions=self.scheduler.num_preemptions, num_steps=self.num_steps,
                    compilations_after_warmup=self.step_fn.compilations_after_warmup,
                    programs_compiled=self.step_fn.num_compiled, programs_total=len(self.step_fn.buckets),
                    prefix_cache_queries=pc.queries, prefix_cache_hits=pc.hits,
                    prefix_cache_evictions=pc.evictions, prefix_cache_collisions=pc.collisions,
                    kv_block_size=self.pool.block_size,
                    sessions_open=len(self.sessions), session_pinned_blocks=self.sessions.num_blocks,
                    kv_blocks_total=self.baseline_free_blocks, kv_blocks_used=self.baseline_free_blocks - free,
                    kv_blocks_reserved=c.kv_blocks_reserved if busy else 0,
                    kv_pressure_rejections=c.kv_pressure_rejections, requests_total=c.requests,
                    decode_batch_last_rows=c.decode_rows_last if busy else 0,
                    decode_batch_rows_total=c.decode_rows, decode_batch_steps_total=c.decode_steps,
                    decode_batch_max=c.decode_rows_max, constrained_steps_total=c.mask_steps,
                    constrained_rows_total=c.mask_rows, constraint_mask_seconds_total=c.mask_seconds,
                    step_host_seconds_total=self.host_seconds, step_device_seconds_total=self.device_seconds,
                    overlapped_steps_total=c.overlapped_steps, banned_rewinds_total=c.banned_rewinds,
                    spec_drafted_total=c.spec_drafted, spec_accepted_total=c.spec_accepted,
                    spec_emitted_total=c.spec_emitted, spec_verify_steps_total=c.spec_verify_rows,
                    spec_miss_steps_total=c.spec_miss_rows, spec_verify_wall_ms_total=1000 * c.spec_verify_seconds)


def _slice_ids(seq: Sequence, start: int, n: int) -> list[int]:
    """The known token ids start..start+n-1 of `seq` (fewer at its end), without joining prompt and output."""
    k = len(seq.prompt_ids)
    if start >= k:
        return seq.output_ids[start - k:start - k + n]
    return seq.prompt_ids[start:start + n] + (seq.output_ids[:start + n - k] if start + n > k else [])


def _has_penalty(p) -> bool:
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1
