"""The messages an engine thread takes from its inbox, one dataclass per command.

The asyncio side builds a command and puts it in the inbox (engine_thread.py); the engine thread
applies it, dispatching by type, and answers through `reply` on its own thread. A command still in
the inbox when the thread has stopped is answered by `refuse()`, so no caller waits forever.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from imp_jax.errors import EngineError
from imp_jax.runtime.request import GenerationRequest

Reply = Callable[[Any], None]


def _stopped(what: str = "engine") -> EngineError:
    return EngineError(f"the {what} stopped", code="engine_stopped", status=503)


@dataclasses.dataclass
class Command:
    """A command answered through `reply` (set by EngineThread._ask_future), or not answered at all."""

    reply: Reply | None = dataclasses.field(default=None, kw_only=True, repr=False)

    def answer(self, value: Any) -> None:
        if self.reply is not None:
            self.reply(value)

    def stopped(self) -> Any:
        """The answer once the engine thread has stopped without applying this command."""
        return _stopped()

    def refuse(self) -> None:
        self.answer(self.stopped())


@dataclasses.dataclass
class Stop(Command):
    """End the engine thread's loop (shutdown)."""


@dataclasses.dataclass
class Wake(Command):
    """Nothing to apply: ends the engine thread's wait for a command (EngineThread.wake: a disk read landed)."""


# ------------------------------------------------------------------ generation engine (async_engine.py)
@dataclasses.dataclass
class AddRequest(Command):
    """Admit `req`; its events (or the ImpError refusing it) go to `emit`."""

    req: GenerationRequest
    emit: Reply

    def answer(self, value: Any) -> None:
        self.emit(value)   # an ImpError refusing it goes where its events would


@dataclasses.dataclass
class Cancel(Command):
    request_id: str

    def refuse(self) -> None:
        pass   # nothing runs any more: nothing to cancel


@dataclasses.dataclass
class EndThinking(Command):
    request_id: str

    def stopped(self) -> str:
        return "unknown"


@dataclasses.dataclass
class Suspend(Command):
    """Operator suspend: answered once the requests in flight finished and the weights are parked."""

    def stopped(self) -> dict[str, Any]:
        return {"status": "stopped"}


@dataclasses.dataclass
class Resume(Command):
    def stopped(self) -> dict[str, Any]:
        return {"status": "stopped"}


@dataclasses.dataclass
class CloseSession(Command):
    session_id: str

    def stopped(self) -> bool:
        return False


@dataclasses.dataclass
class LoadLora(Command):
    """Put an adapter already read from disk (AdapterSlots.read) in a free slot under `name`."""

    name: str
    adapter: Any


@dataclasses.dataclass
class UnloadLora(Command):
    """Free `name`'s slot once its requests end; answered with its description, or None."""

    name: str

    def stopped(self) -> None:
        return None


@dataclasses.dataclass
class KeepLora(Command):
    """Call off `name`'s pending unload; answered with the requests still using it, or None."""

    name: str

    def stopped(self) -> None:
        return None


# ------------------------------------------------------------------ encoder engine (encoder_engine.py)
@dataclasses.dataclass
class Encode(Command):
    """Run encoder inputs (token ids, token type ids); answered with their rows once the last is done."""

    items: list[tuple[list[int], list[int]]]
    out: Any = None    # the rows so far (a numpy array, filled by the engine thread)
    left: int = 0      # inputs not yet run

    def stopped(self) -> EngineError:
        return _stopped("encoder")
