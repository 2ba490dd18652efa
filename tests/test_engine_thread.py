"""EngineThread (runtime/core/engine_thread.py), the base of both engine threads, on a model-free engine:
commands answered by type, refusals and failures answered instead of raised, a load failure marking
the engine faulted, and shutdown answering every command it never took."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading

import pytest

from imp_jax.errors import EngineError, InvalidRequestError
from imp_jax.runtime.core.commands import CloseSession, Command, EndThinking, Suspend
from imp_jax.runtime.core.engine_thread import EngineThread

log = logging.getLogger("test_engine_thread")


@dataclasses.dataclass
class Echo(Command):
    value: object


class EchoEngine(EngineThread):
    """Answers Echo with its value; anything else is a bug (TypeError); `gate` holds the thread."""

    def __init__(self, load_error: Exception | None = None):
        super().__init__("test-echo", "echo engine", log)
        self.load_error = load_error
        self.gate = threading.Event()
        self.gate.set()

    def _load(self) -> None:
        if self.load_error is not None:
            raise self.load_error

    def _serve(self) -> None:
        while self._drain(block=True):
            self.gate.wait()

    def _apply(self, command: Command) -> None:
        self.gate.wait()
        if not isinstance(command, Echo):
            raise TypeError(f"no command {type(command).__name__}")
        if isinstance(command.value, Exception):
            raise command.value
        command.answer(command.value)


def test_commands_are_answered_and_failures_come_back_as_errors() -> None:
    engine = EchoEngine()
    engine.start()

    async def run() -> None:
        await engine.wait_ready()
        assert engine.state == "ready"
        assert await engine._ask(Echo(42)) == 42
        with pytest.raises(InvalidRequestError):   # a refusal reaches the caller as it was raised
            await engine._ask(Echo(InvalidRequestError("bad", param="x")))
        with pytest.raises(EngineError, match="EndThinking failed"):   # a bug: logged, answered, thread lives
            await engine._ask(EndThinking("r1"))
        assert await engine._ask(Echo("still serving")) == "still serving"

    asyncio.run(run())
    engine.shutdown()
    assert engine.state == "stopped"


def test_a_load_failure_marks_the_engine_faulted() -> None:
    engine = EchoEngine(load_error=RuntimeError("no such weights"))
    engine.start()
    with pytest.raises(EngineError, match="echo engine failed to start: no such weights"):
        asyncio.run(engine.wait_ready())
    assert engine.state == "faulted" and engine.error == "no such weights"
    engine.shutdown()


def test_shutdown_answers_what_was_queued_and_refuses_what_comes_after() -> None:
    engine = EchoEngine()
    engine.start()

    async def run() -> None:
        await engine.wait_ready()
        engine.gate.clear()   # the thread holds the first command; the rest wait in the inbox
        first = engine._ask_future(Echo("first"))
        queued = [engine._ask_future(c) for c in (Suspend(), CloseSession("s"), EndThinking("r"), Echo("x"))]
        await asyncio.sleep(0.1)
        stopper = threading.Thread(target=engine.shutdown, args=(0.2,))
        stopper.start()   # cannot join the held thread: refuses the inbox after its timeout
        await asyncio.get_running_loop().run_in_executor(None, stopper.join)
        answers = await asyncio.gather(*queued, return_exceptions=True)
        assert answers[:3] == [{"status": "stopped"}, False, "unknown"]
        assert isinstance(answers[3], EngineError) and answers[3].code == "engine_stopped"
        with pytest.raises(EngineError) as err:
            engine._ask_future(Echo("late"))
        assert (err.value.code, err.value.status) == ("engine_stopped", 503)
        engine.gate.set()
        assert await first == "first"   # what the thread had taken it still answers

    asyncio.run(run())
    engine._thread.join(5)
    assert not engine._thread.is_alive()   # the busy thread ended once it drained again


def test_a_closed_readers_loop_drops_the_value_and_says_so():
    """The engine thread delivering to an event loop that has closed (a client script that ended with
    requests in flight) drops the value and runs `gone`, instead of raising into the engine's step."""
    from imp_jax.runtime.core.engine_thread import to_loop

    loop = asyncio.new_event_loop()
    got, gone = [], []
    deliver = to_loop(loop, got.append, gone=lambda: gone.append(True))
    deliver(1)
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()
    deliver(2)
    assert got == [1] and gone == [True]
    to_loop(loop, got.append)(3)   # without `gone`: dropped quietly
    assert got == [1]
