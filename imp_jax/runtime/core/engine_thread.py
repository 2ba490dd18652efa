"""EngineThread: one engine's worker thread and its inbox, shared by the generation and encoder engines.

Written once here: starting the thread, loading on it (a failure marks the engine faulted),
submitting commands (refused once the engine stopped), asking a command and awaiting its answer
from asyncio, draining the inbox, and at shutdown answering whatever was never taken.
"""
from __future__ import annotations

import abc
import asyncio
import logging
import queue
import threading
from typing import Any, Callable

from imp_jax.errors import EngineError, ImpError
from imp_jax.runtime.core.commands import Command, Stop, Wake

DRAIN_WAIT_S = 0.5   # how long an idle engine thread waits for a command before looking at its own work


def to_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[Any], None],
            gone: Callable[[], None] | None = None) -> Callable[[Any], None]:
    """A callback for the engine thread that runs `fn(value)` on `loop`. Once that loop has closed (its
    reader is gone: a client script ended with requests in flight) the value is dropped and `gone` runs,
    instead of the engine thread meeting "Event loop is closed" as a failed step."""
    def deliver(value: Any) -> None:
        try:
            loop.call_soon_threadsafe(fn, value)
        except RuntimeError:
            if not loop.is_closed():
                raise
            if gone is not None:
                gone()
    return deliver


class EngineThread(abc.ABC):
    """Subclasses load in `_load()` and run their loop in `_serve()`, applying commands in `_apply()`."""

    # declared at class level: they implement the Engine protocol's read-only facts
    state: str = "loading"     # loading | warming_up | ready | suspended | faulted | stopped
    error: str | None = None   # why it faulted

    def __init__(self, name: str, what: str, log: logging.Logger):
        self._what = what               # how messages name this engine ("engine", "encoder minilm")
        self._log = log
        self._inbox: queue.Queue[Command] = queue.Queue()
        self._ready = threading.Event()
        self._submit_lock = threading.Lock()   # a submission and shutdown's refusal never interleave
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Load on the engine thread; returns at once."""
        self._thread.start()

    async def wait_ready(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._ready.wait)
        if self.state != "ready":
            raise EngineError(f"{self._what} failed to start: {self.error}")

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread (after the command it is applying), then refuse what is still queued."""
        self._inbox.put(Stop())
        if self._thread.is_alive():
            self._thread.join(timeout)
        with self._submit_lock:
            self.state = "stopped"
            while True:
                try:
                    self._inbox.get_nowait().refuse()
                except queue.Empty:
                    break
            self._inbox.put(Stop())   # a thread still busy past `timeout` ends when it next drains

    # ---------------------------------------------------------------- asyncio side
    def _submit(self, command: Command) -> None:
        """Queue `command` for the engine thread; 503 engine_stopped once it has stopped."""
        with self._submit_lock:
            if self.state == "stopped":
                raise EngineError(f"the {self._what} stopped", code="engine_stopped", status=503)
            self._inbox.put(command)

    def wake(self) -> None:
        """End the engine thread's wait for a command now (any thread): work it waits on became ready."""
        self._inbox.put(Wake())

    def _ask_future(self, command: Command) -> asyncio.Future[Any]:
        """Submit `command`; the future of its answer (an exception when the answer is one)."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Any] = loop.create_future()

        def resolve(value: Any) -> None:
            if not answer.done():
                (answer.set_exception if isinstance(value, BaseException) else answer.set_result)(value)

        command.reply = to_loop(loop, resolve)
        self._submit(command)
        return answer

    async def _ask(self, command: Command) -> Any:
        """A command answered by the engine thread."""
        return await self._ask_future(command)

    # ---------------------------------------------------------------- engine thread
    def _main(self) -> None:
        try:
            self._load()
        except Exception as e:  # reported by wait_ready and /ready (the server's start-up exits on it)
            if isinstance(e, ImpError):   # a bad path, a corrupt or unsupported file: the message says it
                self._log.error("%s failed to start: %s", self._what, e.message)
            else:
                self._log.exception("%s failed to start", self._what)
            self.error, self.state = str(e), "faulted"
            self._ready.set()
            return
        with self._submit_lock:
            stopped = self.state == "stopped"   # shut down while it loaded: it stays stopped
            if not stopped:
                self.state = "ready"
        self._ready.set()
        if not stopped:
            self._serve()

    def _drain(self, block: bool) -> bool:
        """Apply every queued command (waiting up to DRAIN_WAIT_S for one if `block`); False on Stop."""
        try:
            command = self._inbox.get(timeout=DRAIN_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(command, Stop):
                return False
            if not isinstance(command, Wake):
                self._apply_answered(command)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _apply_answered(self, command: Command) -> None:
        """Apply `command`; a refusal or a failure is its answer, never the thread's exception."""
        try:
            self._apply(command)
        except ImpError as e:   # a refusal (bad input, wrong state): the caller's answer
            command.answer(e)
        except Exception as e:   # never leave a caller waiting
            self._log.exception("%s: %s failed", self._what, type(command).__name__)
            command.answer(EngineError(f"{type(command).__name__} failed: {e}"))

    @abc.abstractmethod
    def _load(self) -> None:
        """Build the engine (on the thread)."""

    @abc.abstractmethod
    def _serve(self) -> None:
        """The engine's loop, until a Stop."""

    @abc.abstractmethod
    def _apply(self, command: Command) -> None:
        """Carry out one command from the inbox."""
