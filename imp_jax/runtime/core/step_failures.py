"""Failure isolation: an exception in a step fails the requests it touches, and the loop goes on.

One sequence's host work (its row's inputs, reading its token, its text) fails its own request; a whole
step (scheduling, building, launching or reading it) fails the requests in `scope`: the step's chunks and
those of the step in flight beside it. Each failed request ends with a 500 `engine_step_failed` error event
and its blocks freed. A device fault (runtime/core/faults.py) is re-raised for the AsyncEngine to fault on.
"""
from __future__ import annotations

import logging
from typing import Callable

from imp_jax.runtime.core.engine_stats import EngineCounters
from imp_jax.runtime.core.faults import is_device_fault, is_oom
from imp_jax.runtime.core.request_state import RequestState
from imp_jax.runtime.scheduling.scheduler import ScheduledChunk
from imp_jax.runtime.scheduling.sequence import Sequence, SeqStatus

log = logging.getLogger("imp_jax.engine")
# tests: called with (stage, sequences) at "prepare", "launch", "read", "advance" and "emit"; an exception
# it raises is handled as a real fault at that stage would be
FaultHook = Callable[[str, list[Sequence]], None]
EndRequest = Callable[..., None]                    # EngineCore._end(state, reason, error=, code=)


class StepFailures:
    """Fails what an exception touches; `hook` is the test-only fault injector (None in production)."""

    def __init__(self, counters: EngineCounters, requests: dict[str, RequestState], end: EndRequest,
                 multi_host: bool):
        self.counters, self.requests, self.end, self.multi_host = counters, requests, end, multi_host
        self.scope: list[ScheduledChunk] = []   # what a whole-step failure now fails
        self.hook: FaultHook | None = None
        self._oom_before = False                # the last step failed out of memory: a second one is a fault

    def inject(self, stage: str, seqs: list[Sequence]) -> None:
        if self.hook is not None:
            self.hook(stage, seqs)

    def stepped(self) -> None:
        """A step ran through: an out-of-memory after it is a first one again."""
        self._oom_before = False

    def fail(self, states: set[RequestState], e: BaseException, stage: str) -> None:
        """Fail `states` with engine_step_failed after `e` (logged once), unless it is a device fault."""
        if is_device_fault(e, self.multi_host, self._oom_before):
            raise e
        self._oom_before = is_oom(e)
        self.counters.steps_failed += 1
        log.error("engine step failed at %s (%s: %s); failing requests %s, serving the others",
                  stage, type(e).__name__, e, sorted(s.request_id for s in states))
        log.debug("the failed step's traceback", exc_info=e)
        for state in states:
            if state.request_id in self.requests:
                self.counters.requests_failed += 1
                self.end(state, "error", error=f"the engine step failed ({type(e).__name__})",
                         code="engine_step_failed")

    def fail_step(self, e: BaseException) -> None:
        """A whole step failed: the requests in scope fail (the caller drops the step in flight)."""
        chunks, self.scope = self.scope, []
        ids = {c.seq.request.request_id for c in chunks}
        self.fail({self.requests[i] for i in ids if i in self.requests}, e, "step")
        for state in self.requests.values():   # a pending token of a dropped step is never read
            if any(seq.pending and seq.finish_reason is None for seq in state.seqs):
                raise RuntimeError(f"request {state.request_id} waits for a dropped step") from e

    def fail_seq(self, seq: Sequence, e: BaseException, stage: str) -> None:
        state = self.requests.get(seq.request.request_id)
        self.fail({state} if state is not None else set(), e, stage)

    def guard(self, stage: str, seq: Sequence, work: Callable[[], None]) -> None:
        """Run one sequence's host work (none once it finished); an exception fails its request only."""
        if seq.status is SeqStatus.FINISHED:
            return
        try:
            self.inject(stage, [seq])
            work()
        except Exception as e:
            self.fail_seq(seq, e, stage)
