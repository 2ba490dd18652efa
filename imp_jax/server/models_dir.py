"""A directory of models (`--models-dir DIR`) served one at a time, swapped on demand.

Every model in the directory (a `.gguf` file, an HF directory, a converted checkpoint; named as
the server would serve it: the file or directory name) is listed on `/v1/models` with `loaded`.
A request naming another of them swaps (when its caller may: ModelDirectory): new requests wait, the
current model finishes what it has in flight (nothing is cancelled), its engine stops, the other
loads, and the waiting requests are served by it. `/ready` answers 503 `swapping` meanwhile.
`POST /admin/models/load` swaps explicitly. With `--models-dir` and no `--model`, the server
starts with no model (`/ready` 503 `no_model`) until the first request or load names one.
A swap drops every LoRA adapter of the old model (one log line each; imp's rule: nothing is re-loaded
onto the new model, POST /admin/lora/load again), and a model that fails to load is replaced by the
previous one again, so a failed swap never leaves the server with no model.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from imp_jax.errors import EngineError, ImpError, ModelLoadError
from imp_jax.runtime.api import Capabilities, Engine, not_serving
from imp_jax.runtime.config import models_in
from imp_jax.runtime.request import EngineEvent, GenerationRequest, StreamLimits
from imp_jax.server.errors import Refusal, unavailable

log = logging.getLogger("imp_jax.server")

DRAIN_POLL_S = 0.05


def _no_model_fact(name: str) -> property:
    def fact(self: NoModel) -> Any:
        raise EngineError(f"no model is loaded: no {name} yet", code="no_model", status=503)
    return property(fact)


class NoModel(Engine):
    """The engine slot before the first model is loaded: every model fact is unknown, nothing runs."""

    state = "no_model"
    error = None
    idle_suspended = False
    capabilities = Capabilities()
    served_name = _no_model_fact("served name")
    tokenizer = _no_model_fact("tokenizer")
    max_model_len = _no_model_fact("context length")
    vocab_size = _no_model_fact("vocabulary")
    default_params = _no_model_fact("defaults")
    max_num_seqs = _no_model_fact("sizing")
    dtype = _no_model_fact("dtype")
    device = _no_model_fact("device")

    def start(self) -> None:
        pass

    async def wait_ready(self) -> None:
        raise not_serving(self.state, None)

    def shutdown(self, timeout: float = 0.0) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {}

    def generate(self, req: GenerationRequest, limits: StreamLimits = StreamLimits(),
                 on_stall: Callable[[], None] | None = None) -> AsyncIterator[EngineEvent]:
        raise not_serving(self.state, None)

    def cancel(self, request_id: str) -> None:
        pass   # nothing runs


class ModelDirectory:
    """The directory's models and the one swap in progress (if any).

    Swap policy (docs/SECURITY.md): a request swaps only when its caller may (`admin`, or
    --swap-on-request), and not before the loaded model has served `min_residency_s` (a 503 with
    Retry-After); `POST /admin/models/load` is held to neither. At most one swap is pending: a request
    naming a third model meanwhile gets 503 `swapping` at once instead of queueing a swap back.
    """

    def __init__(self, directory: Path, make_engine: Callable[[Path], Engine], swap_timeout_s: float,
                 current: Path | None = None, min_residency_s: float = 0.0):
        self.directory = directory
        self._make_engine = make_engine
        self._current = current   # where the engine serving now came from (None: no model yet)
        self._swap_timeout_s = swap_timeout_s
        self._min_residency_s = min_residency_s
        self._since = time.monotonic() if current is not None else None   # when the current model began serving
        self._lock = asyncio.Lock()
        self.swapping_to: str | None = None   # the one pending swap's model, from the moment it is asked for
        self._leases = 0   # requests handed the current engine that may not have reached it yet

    def release(self) -> None:
        """A request handed an engine by `ensure` is done with the handoff (app teardown)."""
        self._leases -= 1

    def models(self) -> dict[str, Path]:
        """Scanned on each call: models added to the directory appear without a restart."""
        return models_in(self.directory)

    def __contains__(self, name: str) -> bool:
        return name in self.models()

    def offers(self, state: Any, name: str) -> bool:
        """Whether `name` is served now or can be swapped to (the directory is read only for another name)."""
        return _served(state.engine) == name or name in self

    async def ensure(self, state: Any, name: str, may_swap: bool) -> Engine:
        """A request's engine for `name` (`serving`, as a request: `may_swap` says whether its caller may
        swap), leased until `release()`: a swap waits for leases as for requests in flight, so a request
        never reaches an engine stopped after the handover."""
        engine = await self.serving(state, name, by_request=True, may_swap=may_swap)
        self._leases += 1
        return engine

    async def serving(self, state: Any, name: str, by_request: bool = False, may_swap: bool = True) -> Engine:
        """The engine serving `name`, swapping to it first if another (or none) is loaded; only the caller
        that asks for a swap first makes it, others naming the same model wait for it (class docstring)."""
        loaded = self._loaded_name(state)
        if self.swapping_to is None and not self._lock.locked() and _served(state.engine) == name:
            return state.engine   # the common case: no swap, no wait
        owner = self.swapping_to is None and loaded != name
        if owner:
            if by_request:
                self._check_request_swap(name, may_swap)
            self.swapping_to = name
        elif self.swapping_to not in (None, name):
            raise unavailable("a swap to another model is under way; retry in a few seconds", "swapping")
        try:
            async with self._lock:
                return await self._switch(state, name, owner)
        finally:
            if owner:
                self.swapping_to = None

    def _check_request_swap(self, name: str, may_swap: bool) -> None:
        """A 403 naming `model` when the caller may not swap; a 503 with Retry-After while the loaded model
        has served less than its minimum residency (a client alternating models would keep it swapping)."""
        if not may_swap:
            raise ImpError(f"model '{name}' is not loaded, and on this server only admin callers' requests swap "
                           "models (the operator's --admin-key or --swap-on-request)", code="not_granted",
                           status=403, param="model")
        wait = 0.0 if self._since is None else self._since + self._min_residency_s - time.monotonic()
        if wait > 0:
            retry = max(1, math.ceil(wait))
            raise Refusal(f"the loaded model has served less than --swap-min-seconds "
                          f"{self._min_residency_s:g}; the swap to '{name}' may be asked for in {retry} s",
                          status=503, code="swap_too_soon", headers={"Retry-After": str(retry)})

    async def _switch(self, state: Any, name: str, owner: bool) -> Engine:
        """Under the lock: the engine once it serves `name`; only the owner of the pending swap loads it."""
        current = state.engine
        if current.state in ("loading", "warming_up"):
            try:
                await current.wait_ready()   # what it serves is known once it has loaded
            except Exception:
                pass   # a failed load: swap away from it
        if _served(current) == name:
            return current
        if not owner:   # the swap this request waited for did not end serving `name`
            raise ImpError(f"loading model '{name}' failed; the server log says why", code="model_load_failed",
                           status=503)
        path = self.models().get(name)
        if path is None:
            raise ModelLoadError(f"model '{name}' is not in {self.directory}")
        return await self._swap(state, current, name, path)

    def _loaded_name(self, state: Any) -> str | None:
        """The model served now, or being loaded as the current one (its directory entry's name)."""
        served = _served(state.engine)
        if served is None and state.engine.state in ("loading", "warming_up") and self._current is not None:
            return self._current.name
        return served

    async def _swap(self, state: Any, old: Engine, name: str, path: Path) -> Engine:
        t0 = time.monotonic()
        log.info("swapping to model '%s': finishing %d in-flight request(s) first", name, in_flight(old))
        deadline = t0 + self._swap_timeout_s
        while (in_flight(old) or self._leases) and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if in_flight(old) or self._leases:
            raise ImpError(f"the swap to '{name}' timed out waiting for in-flight requests", code="swap_timeout",
                           status=503)
        _drop_adapters(old, name)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, old.shutdown)
        try:
            new = await self._start(state, path)
        except Exception as e:
            log.error("loading model '%s' failed: %s", name, e)
            await self._restore(state, name)
            raise ImpError(f"loading model '{name}' failed; the server log says why", code="model_load_failed",
                           status=503) from e
        self._current, self._since = path, time.monotonic()
        log.info("swapped to model '%s' in %.1f s", name, time.monotonic() - t0)
        return new

    async def _start(self, state: Any, path: Path) -> Engine:
        engine = self._make_engine(path)
        state.engine = engine
        engine.start()
        await engine.wait_ready()
        return engine

    async def _restore(self, state: Any, failed: str) -> None:
        """After a failed load: the model served before it again (none if there was none, or it fails too)."""
        state.engine = NoModel()
        if self._current is None:
            return
        log.info("restoring model '%s' after the failed swap to '%s'", self._current.name, failed)
        try:
            await self._start(state, self._current)
            self._since = time.monotonic()
        except Exception as e:   # noqa: BLE001 - reported, and the server answers no_model
            log.error("restoring model '%s' failed too: %s; serving no model", self._current.name, e)
            state.engine, self._current, self._since = NoModel(), None, None


def _drop_adapters(old: Engine, name: str) -> None:
    """One log line per LoRA adapter the swap drops with the old model (runtime and start-up ones alike)."""
    if not old.capabilities.lora or old.state != "ready":
        return
    for a in old.lora_adapters():
        log.info("model swap: dropped LoRA adapter '%s' (id=%s, path=%s): swapping to '%s'",
                 a["name"], a["id"], a["path"], name)


def _served(engine: Any) -> str | None:
    try:
        return engine.served_name
    except Exception:
        return None


def in_flight(engine: Any) -> int:
    """Requests the engine holds (running or waiting); 0 when it has no stats (not loaded, no model)."""
    try:
        stats = engine.stats()
    except Exception:
        return 0
    return int(stats.get("num_running", 0)) + int(stats.get("num_waiting", 0))
