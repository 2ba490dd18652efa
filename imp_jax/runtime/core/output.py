"""The output stage: a read step's tokens join their sequences, and become events.

Per sampled token: the sequence's output and prefix-cache blocks move on, the features see it
(`Feature.accepted`), then its text is made (incremental detokenizing, think/answer split, banned
phrases held back and rewound, stop strings, a harmony reply's calls read as values) and sent, or
deferred to overlap the next step's launch.
The end of a sequence frees it; the end of a request carries usage and releases what it held.
"""
from __future__ import annotations

import logging
from typing import Any

from imp_jax.runtime.decoding import cfg as guidance
from imp_jax.runtime.decoding.banned import REGEX_SPENT, REGEX_SPENT_EXTRA
from imp_jax.runtime.features import Accepted, EndSequence, Feature, Services
from imp_jax.runtime.kv.kv_blocks import OutOfBlocks
from imp_jax.runtime.replies.calls import TextDelta
from imp_jax.runtime.replies.reasoning import ANSWER, THINK
from imp_jax.runtime.replies.tool_calls import answer_events
from imp_jax.runtime.request import EngineEvent, TokenLogprob, Usage
from imp_jax.runtime.core.request_state import RequestState
from imp_jax.runtime.scheduling.sequence import Sequence, SeqStatus
from imp_jax.runtime.scheduling.sessions import SessionPins

log = logging.getLogger("imp_jax.engine")


class OutputStage:
    """Advances sequences from read steps and emits their events; owns the deferred text queue."""

    def __init__(self, services: Services, features: list[Feature], requests: dict[str, RequestState],
                 sessions: SessionPins):
        self.s = services
        self.features = features
        self.requests = requests
        self.sessions = sessions
        self.deferred: list[tuple[Sequence, int, Any, RequestState, str, dict[int, float] | None]] = []

    # --------------------------------------------------------------- tokens
    def advance(self, seq: Sequence, samples: bool, out, row: int, first: bool = True, defer: bool = True,
                verified: bool = False) -> None:
        """A read step's row: its sampled token joins the sequence (num_computed moved at launch). A
        sequence preempted since the launch keeps its token (it recomputes its KV when readmitted).
        A verify chunk's later tokens (`first` False) were not counted pending; `defer` False emits
        the token's text now (the next token joins the sequence only after)."""
        if seq.status is SeqStatus.FINISHED:
            return
        pool = self.s.pool
        if seq.main is not None:   # a CFG shadow: its main's row feeds it (runtime/decoding/cfg.py); it emits nothing
            if seq.status is SeqStatus.RUNNING:
                pool.commit(seq.table, seq.all_ids[:seq.num_computed], seq.cache_key)
            return
        state = self.requests[seq.request.request_id]
        token = None
        if samples:
            token = int(out.tokens[row])
            seq.pending -= first
            seq.output_ids.append(token)
        if seq.status is SeqStatus.RUNNING:
            # every token with KV written (or being written by a launched step) is known now
            pool.commit(seq.table, seq.all_ids[:seq.num_computed], seq.cache_key)
            if seq.request.cache_prompt and not seq.pinned and seq.num_computed >= len(seq.prompt_ids):
                pool.pin(seq.table, seq.request.pinned_blocks(pool.block_size))
                seq.pinned = True
        if not samples:
            return
        logprobs = None
        if seq.params.logprobs is not None:
            k = seq.params.logprobs
            top = [(int(t), float(v)) for t, v in zip(out.top_ids[row, :k], out.top_logprobs[row, :k])]
            logprobs = [TokenLogprob(token, float(out.logprob[row]), top)]
        tok = Accepted(token, out, row, ANSWER, logprobs, verified=verified)
        try:
            for f in self.features:
                f.accepted(seq, tok)
        except EndSequence as e:
            self.finish(seq, "error", state, error=str(e))
            return
        if tok.prompt_logprobs is not None:
            state.prompt_logprobs = tok.prompt_logprobs
        if not defer or self.ends_without_text(seq, token) or seq.banned is not None:   # a rewind lands first
            self.emit_token(seq, token, tok.logprobs, state, tok.kind, tok.raw)
        else:
            self.deferred.append((seq, token, tok.logprobs, state, tok.kind, tok.raw))

    def ends_without_text(self, seq: Sequence, token: int) -> bool:
        """Whether `token` ends `seq` for a reason its text plays no part in (EOS, a stop token id,
        max_tokens, a pool too small): then its event goes out now. Any other token's text work
        (detokenizing, stop strings) waits for the next step's launch, so it overlaps that step;
        a stop string found then costs the sequence one token of compute, which is dropped."""
        p = seq.params
        n_out = len(seq.output_ids)
        stops = (token in self.s.tokenizer.eos_ids and not p.ignore_eos) or token in p.stop_token_ids
        return ((stops and n_out > p.min_tokens) or n_out >= seq.max_tokens
                or guidance.kv_blocks(self.s.pool, seq) > self.s.baseline_free_blocks)

    def emit_deferred(self) -> None:
        """The text events `advance` deferred, in order; a sequence ended meanwhile (cancelled) has none."""
        deferred, self.deferred = self.deferred, []
        for seq, token, logprobs, state, kind, raw in deferred:
            if seq.status is not SeqStatus.FINISHED:
                self.emit_token(seq, token, logprobs, state, kind, raw)

    # ----------------------------------------------------------------- text
    def emit_token(self, seq: Sequence, token: int, logprobs, state: RequestState, kind: str = ANSWER,
                   raw: dict[int, float] | None = None) -> None:
        """`kind` (runtime/replies/reasoning.py): think text goes to reasoning_text, past stop strings; a marker has no
        text. `raw`: the raw logprobs of the request's raw_logprob_ids where this token was sampled."""
        p = seq.params
        n_out = len(seq.output_ids)
        is_eos = token in self.s.tokenizer.eos_ids and not p.ignore_eos
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
                    self.close(seq, state, EngineEvent(seq.request.request_id, seq.index, finish_reason="error",
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
        too_big = guidance.kv_blocks(self.s.pool, seq) > self.s.baseline_free_blocks   # with a CFG shadow's
        if finish is None and (n_out >= seq.max_tokens or too_big):
            finish = "length"
            if too_big and n_out < seq.max_tokens:
                self.s.counters.kv_pressure_rejections += 1
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
            self.send(seq, state, event)
            return
        seq.finish_reason = finish
        event.finish_reason, event.stop_reason = finish, stop_reason
        self.close(seq, state, event)

    @staticmethod
    def _answer_delta(seq: Sequence, token: int) -> str:
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
        next step samples the position anew, with the token banned there (features/banned.py)."""
        self.s.counters.banned_rewinds += 1
        seq.detok.restore(held.detok)
        del seq.output_ids[held.position:]
        log.debug("banned_rewind request=%s index=%d position=%d token=%d rewinds_left=%d",
                  seq.request.request_id, seq.index, held.position, held.token, seq.banned.budget.left)
        if seq.status is not SeqStatus.RUNNING:
            return   # preempted: it recomputes its KV from the shortened output when readmitted
        keep = len(seq.prompt_ids) + held.position - 1
        try:
            copy = self.s.pool.truncate(seq.table, keep)
        except OutOfBlocks:
            self.s.scheduler.preempt(seq)
            return
        # a shared tail block was swapped for a fresh one: recompute its tokens rather than copy it on device
        seq.num_computed = keep if copy is None else keep - keep % self.s.config.block_size

    def _release_held(self, seq: Sequence, state: RequestState) -> bool:
        """Send the held tokens (a token without answer text follows, or phrases stopped applying);
        whether their text completed a stop string, which ends the sequence."""
        ids, logprobs, delta = seq.banned.flush()
        text, matched = (delta, None) if len(seq.output_ids) <= seq.params.min_tokens else seq.stops.feed(delta)
        event = EngineEvent(seq.request.request_id, seq.index, ids, text,
                            logprobs=logprobs if seq.params.logprobs is not None else None)
        self._attach_prompt_logprobs(seq, state, event)
        if matched is None:
            self.send(seq, state, event)
            return False
        seq.finish_reason = event.finish_reason = "stop"
        event.stop_reason = matched
        self.close(seq, state, event)
        return True

    @staticmethod
    def _attach_prompt_logprobs(seq: Sequence, state: RequestState, event: EngineEvent) -> None:
        """The request's prompt logprobs ride on its first sequence's first event."""
        if seq.index == 0 and state.prompt_logprobs is not None:
            event.prompt_logprobs, state.prompt_logprobs = state.prompt_logprobs, None

    # ------------------------------------------------------------------ end
    def finish(self, seq: Sequence, reason: str, state: RequestState, error: str | None = None,
               code: str | None = None) -> None:
        seq.finish_reason = reason
        event = EngineEvent(seq.request.request_id, seq.index, finish_reason=reason, error=error)
        if code is not None:
            event.extra["code"] = code
        self.close(seq, state, event)

    def close(self, seq: Sequence, state: RequestState, event: EngineEvent) -> None:
        """Free the sequence (a session's first choice leaves its blocks pinned for the next turn);
        the request's last sequence carries usage and done=True, and releases what the request held."""
        if seq.request.session_id and seq.index == 0 and event.finish_reason != "error":
            self.sessions.keep(seq.request.session_id, seq.table)
        self.s.scheduler.remove(seq)
        state.num_open -= 1
        if state.num_open == 0:
            self.end_request(state)
            first = state.seqs[0]
            extra: dict[str, Any] = {}
            for f in self.features:
                f.usage(state, extra)
            event.usage = Usage(prompt_tokens=len(first.prompt_ids),
                                completion_tokens=sum(len(s.output_ids) for s in state.seqs),
                                cached_tokens=first.cached_prompt_tokens or 0, **extra)
            event.done = True
        self.send(seq, state, event)

    def end_request(self, state: RequestState) -> None:
        """Forget the request and release what its features hold (idempotent)."""
        self.requests.pop(state.request_id, None)
        for f in self.features:
            f.release(state)

    @staticmethod
    def send(seq: Sequence, state: RequestState, event: EngineEvent) -> None:
        _read_calls(seq, event)
        event.admitted_at = state.seqs[0].first_scheduled_at
        state.emit(event)


def _read_calls(seq: Sequence, event: EngineEvent) -> None:
    """With tools offered, a harmony reply's calls leave the engine as values (EngineEvent.answer): its answer
    text, stop strings applied, goes through the tracker's call parser, which holds back what may still be
    markup until the next text or the sequence's end (runtime/replies/harmony.py)."""
    calls = seq.reasoning.calls if seq.reasoning is not None else None
    if calls is not None:
        event.answer = answer_events(calls, event.text, event.finish_reason is not None)
        event.text = "".join(part.text for part in event.answer if isinstance(part, TextDelta))
