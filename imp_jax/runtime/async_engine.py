"""AsyncEngine: the asyncio face of the engine core, which runs on its own thread.

Requests and cancellations go in through a thread-safe queue; events come back to each
request's bounded EventBuffer via `call_soon_threadsafe`, so the engine thread never waits
for a reader, and a reader that stops reading is dropped (event_buffer.py). A step that
raises marks the engine faulted and fails every request in flight with an error event.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable

from imp_jax.errors import EngineError, ImpError, InvalidRequestError
from imp_jax.runtime.config import EngineConfig
from imp_jax.runtime.defaults import model_defaults
from imp_jax.runtime.engine import EngineCore
from imp_jax.runtime.event_buffer import EventBuffer
from imp_jax.runtime.multihost import PEER_LOST
from imp_jax.runtime.request import EngineEvent, GenerationRequest, StreamLimits

log = logging.getLogger("imp_jax.engine")


class AsyncEngine:
    """Start with `start()`; `generate()` streams EngineEvents; `cancel()` frees a request's blocks."""

    def __init__(self, config: EngineConfig, build: Callable[..., EngineCore] | None = None, replica: int = 0):
        self.config = config
        self.replica = replica          # its device group of config.data_parallel_size (runtime/replicas.py)
        self.state = "loading"          # loading | warming_up | ready | suspended | faulted | stopped
        self.idle_suspended = False     # parked for idleness: still "ready", the next request resumes
        self.progress = 0.0
        self.error: str | None = None
        self._build = build
        self._core: EngineCore | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="imp-engine" + (f"-{replica}" if replica else ""),
                                        daemon=True)
        self._compiler: threading.Thread | None = None   # background compiles (builder.compile_in_background)
        self._compiler_lock = threading.Lock()
        self._stopping = False
        self._suspend_waiters: list[Callable[[Any], None]] = []
        self._submit_lock = threading.Lock()
        self._last_request = 0.0

    # --------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Load and warm up on the engine thread; returns at once."""
        self._thread.start()

    async def wait_ready(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._ready.wait)
        if self.state != "ready":
            raise EngineError(f"engine failed to start: {self.error}")

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._compiler_lock:
            self._stopping = True
        self._inbox.put(("stop",))
        if self._thread.is_alive():
            self._thread.join(timeout)
        with self._submit_lock:
            self.state = "stopped"
            self._refuse_queued()
        if self._compiler is not None:   # a compile cut off by the interpreter's exit aborts the process
            self._core.step_fn.stop_compiling()
            self._compiler.join(max(timeout, 60.0))

    def _refuse_queued(self) -> None:
        """Answer what reached the inbox after the engine thread stopped, so no caller waits forever."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "add":
                item[2](EngineError("the engine stopped", code="engine_stopped", status=503))
            elif item[0] not in ("cancel", "stop"):   # "stop": ours, unread when the thread had already ended
                stopped = {"suspend": {"status": "stopped"}, "resume": {"status": "stopped"},
                           "close_session": False, "end_thinking": "unknown", "lora_unload": None, "lora_keep": None,
                           "lora_load": EngineError("the engine stopped", code="engine_stopped", status=503)}
                item[-1](stopped[item[0]])

    # ------------------------------------------------------------------- model
    @property
    def core(self) -> EngineCore:
        if self._core is None:
            raise EngineError("the model is still loading", code="loading", status=503)
        return self._core

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def served_name(self) -> str:
        return self.core.loaded.served_name

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.core.loaded.config.vocab_size

    @property
    def model_config(self):
        return self.core.loaded.config

    @property
    def dtype(self) -> str:
        """The weights' dtype as loaded (what `--dtype auto` resolved to)."""
        import jax.numpy as jnp
        return jnp.dtype(self.core.loaded.dtype).name

    @property
    def device(self) -> str:
        """The platform of the engine's devices: cpu, gpu or tpu."""
        return self.core.step_fn.mesh.devices.flat[0].platform

    @property
    def default_params(self) -> dict[str, Any]:
        return model_defaults(self.core.loaded.generation_config, self.core.loaded.config.architecture)

    def stats(self) -> dict[str, Any]:
        return {"state": self.state, "suspended": self.state == "suspended", "idle_suspended": self.idle_suspended,
                "idle_unload_seconds": self.config.idle_unload_seconds, **(self._core.stats() if self._core else {})}

    # ---------------------------------------------------------------- requests
    async def generate(self, req: GenerationRequest, limits: StreamLimits = StreamLimits(),
                       on_stall: Callable[[], None] | None = None) -> AsyncIterator[EngineEvent]:
        """Submit `req` and stream its events; an ImpError is raised before the first event for bad input.

        A reader that leaves `limits.max_events` events unread for `limits.stall_timeout_s` is
        dropped: the request is cancelled, the task reading it is cancelled, and `on_stall` runs.
        """
        if self.state != "ready":
            code = {"loading": "loading", "warming_up": "loading", "suspended": "suspended"}.get(self.state)
            raise EngineError(f"engine is {self.state}" + (f": {self.error}" if self.error else ""),
                              code=code or "engine_error", status=503)
        loop = asyncio.get_running_loop()
        reader = asyncio.current_task()
        if req.constraint and req.compiled_constraint is None:   # compiled here, never on the engine thread
            req.compiled_constraint = await loop.run_in_executor(None, self.core.constraints.prepare, req.constraint)

        def stalled() -> None:
            log.warning("request %s: the client read nothing for %.0f s with %d events waiting; dropped",
                        req.request_id, limits.stall_timeout_s, limits.max_events)
            self.cancel(req.request_id)
            if on_stall is not None:
                on_stall()
            if reader is not None:
                reader.cancel()

        events = EventBuffer(limits, stalled)
        with self._submit_lock:   # shutdown() answers whatever was submitted before it stopped
            if self.state == "stopped":
                raise EngineError("the engine stopped", code="engine_stopped", status=503)
            self._inbox.put(("add", req, lambda item: loop.call_soon_threadsafe(events.put, item)))
        done = False
        try:
            while True:
                item = await events.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.done
                yield item
                if done:
                    return
        finally:
            events.close()
            if not done:
                self.cancel(req.request_id)

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    async def end_thinking(self, request_id: str) -> str:
        """End the request's think block (EngineCore.end_thinking), answered by the engine thread."""
        return await self._ask("end_thinking", request_id)

    async def suspend(self) -> dict[str, Any]:
        """Operator suspend: refuse new requests (503 suspended), let those in flight finish, then park
        the weights and KV cache in host memory. Sticky until `resume()`."""
        return await self._ask("suspend")

    async def resume(self) -> dict[str, Any]:
        """Put the parked weights and KV cache back on the device and take requests again."""
        return await self._ask("resume")

    async def close_session(self, session_id: str) -> bool:
        """Release a session's pinned KV blocks (runtime/sessions.py); whether it was open."""
        return await self._ask("close_session", session_id)

    async def load_lora(self, name: str, path: str) -> dict[str, Any]:
        """Read the PEFT adapter at `path` (off the engine thread), then put it in a free slot under `name`
        (runtime/lora.py); an ImpError says why not (400 bad adapter, 409 name taken or slots full)."""
        core = self.core
        if core.loras is None:
            raise InvalidRequestError("this server has no LoRA adapter slots; start it with --max-loras N",
                                      code="lora_disabled", param="name")
        adapter = await asyncio.get_running_loop().run_in_executor(None, core.loras.read, path)
        answer = await self._ask("lora_load", name, adapter)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def unload_lora(self, name: str, timeout_s: float | None = None) -> dict[str, Any] | None:
        """Free adapter `name`'s slot once the requests using it end (new ones are refused meanwhile);
        its description, or None when no adapter has that name. Past `timeout_s` with requests still
        using it, the unload is called off, the adapter serves again, and a 503 lora_unload_timeout says so."""
        answer = self._ask_future("lora_unload", name)
        try:
            answer = await asyncio.wait_for(asyncio.shield(answer), timeout_s)
        except asyncio.TimeoutError:
            active = await self._ask("lora_keep", name)
            if active is not None:
                raise ImpError(f"LoRA adapter '{name}' is still used by {active} request(s) after {timeout_s:g} s; "
                               "it stays loaded (retry later, or with a longer 'timeout_s')",
                               code="lora_unload_timeout", status=503, param="timeout_s") from None
            answer = await answer   # it finished meanwhile: the unload's own answer is on its way
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def prefix_key(self, req: GenerationRequest) -> Any:
        """The prefix-cache extra key `req`'s blocks get here (Sequence.cache_key); KeyError when its LoRA
        adapter is not loaded here. Read from another thread (a dict lookup), for routing only."""
        if not req.lora:
            return req.cache_salt
        if self.core.loras is None:
            raise KeyError(req.lora)
        return (req.cache_salt, "lora", *self.core.loras.by_name[req.lora].cache_key)

    def holds_block(self, block_hash: bytes) -> bool:
        """Whether this engine's prefix cache holds a block of that hash (KVBlockPool.holds; any thread)."""
        return self._core is not None and self._core.pool.holds(block_hash)

    def lora_adapters(self) -> list[dict[str, Any]]:
        """The loaded adapters (name, id, path, slot, rank, target_modules); [] without slots."""
        core = self._core
        return list(core.loras.describe()) if core is not None and core.loras is not None else []

    async def _ask(self, kind: str, *args: Any) -> Any:
        """A command answered by the engine thread."""
        return await self._ask_future(kind, *args)

    def _ask_future(self, kind: str, *args: Any) -> asyncio.Future[Any]:
        """A command sent to the engine thread; the future of its answer."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Any] = loop.create_future()

        def resolve(value: Any) -> None:
            if not answer.done():
                answer.set_result(value)

        self._inbox.put((kind, *args, lambda value: loop.call_soon_threadsafe(resolve, value)))
        return answer

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        from imp_jax.runtime.builder import build_engine, compile_in_background

        def progress(phase: str, frac: float) -> None:
            self.state = phase if phase != "ready" else self.state
            self.progress = frac

        try:
            build = self._build or functools.partial(build_engine, background_compile=True, replica=self.replica)
            self._core = build(self.config, progress)
            with self._compiler_lock:
                if not self._core.step_fn.warm and not self._stopping:
                    self._compiler = compile_in_background(self._core)
        except Exception as e:  # reported by /ready and wait_ready (the server's start-up exits on it)
            if isinstance(e, ImpError):   # a bad path, a corrupt or unsupported file: the message says it
                log.error("engine failed to start: %s", e.message)
            else:
                log.exception("engine failed to start")
            self.error, self.state = str(e), "faulted"
            self._ready.set()
            return
        self.state = "ready"
        self._ready.set()
        import jax
        leader = self._core.step_fn.leader   # multi-host process 0 (runtime/multihost.py)
        try:
            with jax.default_device(self._core.step_fn.mesh.devices.flat[0]):   # what this thread makes: its device
                self._serve(self._core)
        finally:
            if leader is not None and self.state != "faulted":
                leader.stop()

    def _serve(self, core: EngineCore) -> None:
        self._last_request = time.monotonic()
        while True:
            warming = not core.has_work() and core.step_fn.has_unrun()
            if not self._drain(block=not core.has_work() and not warming):
                return
            if self.state == "faulted":
                continue
            try:
                if core.has_work():
                    core.step()
                elif self._suspend_waiters:
                    self._park("operator")
                elif warming:
                    core.step_fn.run_one_unrun()   # a newly compiled program's first run, while nobody waits
                elif self._idle_due():
                    self._park("idle")
                else:
                    core.expire_sessions()
                    if core.step_fn.leader is not None:
                        core.step_fn.leader.ping()   # finds a lost process before a request does
            except Exception as e:
                log.exception("engine step failed; failing all requests")
                self.error, self.state = f"device fault: {e}", "faulted"   # /ready says so at once
                self.error = core.step_fn.fault_message(e)   # multi-host: names a lost process (takes seconds)
                core.fail_all(self.error)

    def _idle_due(self) -> bool:
        limit = self.config.idle_unload_seconds
        return (limit > 0 and self.state == "ready" and not self.idle_suspended
                and time.monotonic() - self._last_request >= limit)

    def _park(self, why: str) -> None:
        """Suspend now (the engine has no work): weights and KV cache to host memory."""
        t0 = time.perf_counter()
        freed = 0 if self._core.step_fn.suspended else self._core.step_fn.suspend()
        if why == "idle":
            self.idle_suspended = True
        log.info("suspended (%s): %.0f MiB of weights and KV cache moved to host memory in %.2f s",
                 why, freed / 2**20, time.perf_counter() - t0)
        waiters, self._suspend_waiters = self._suspend_waiters, []
        for reply in waiters:
            reply({"status": "suspended", "freed_bytes": freed})

    def _unpark(self, why: str) -> None:
        t0 = time.perf_counter()
        if self._core.step_fn.suspended:
            self._core.step_fn.resume()
            log.info("resumed (%s) in %.2f s", why, time.perf_counter() - t0)
        self.idle_suspended = False

    def _command_suspend(self, reply: Callable[[Any], None]) -> None:
        if self.state == "faulted":
            reply({"status": "faulted"})
            return
        if self.config.multi_host:   # the other processes' shards cannot be parked from here
            reply({"status": "unsupported"})
            return
        if self.state == "suspended" and not self._suspend_waiters:
            reply({"status": "already_suspended"})
            return
        self.state = "suspended"   # new requests: 503 suspended; those in flight finish first (_run)
        self._suspend_waiters.append(reply)

    def _command_resume(self, reply: Callable[[Any], None]) -> None:
        if self.state != "suspended":
            reply({"status": "faulted" if self.state == "faulted" else "not_suspended"})
            return
        for waiting in self._suspend_waiters:   # a suspend still draining is called off
            waiting({"status": "resumed_before_parking"})
        self._suspend_waiters = []
        self._unpark("operator")
        self._last_request = time.monotonic()
        self.state = "ready"
        reply({"status": "resumed"})

    def _load_lora(self, name: str, adapter: Any) -> Any:
        """Engine thread: the loaded adapter's description, or the ImpError that refused it."""
        if self.state == "suspended":
            return ImpError("the engine is suspended; POST /admin/resume first", code="suspended", status=409)
        if self.state == "faulted":
            return EngineError(f"engine is faulted: {self.error}")
        try:
            if self.idle_suspended:
                self._unpark("a LoRA adapter is loading")
            return self._core.load_lora(name, adapter)
        except ImpError as e:
            return e
        except Exception as e:   # never leave the caller waiting
            log.exception("loading LoRA adapter %r failed", name)
            return EngineError(f"loading the adapter failed: {e}")

    def _drain(self, block: bool) -> bool:
        """Apply queued submissions and cancellations; False when asked to stop."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind = item[0]
            if kind == "stop":
                return False
            if kind == "cancel":
                self._core.cancel(item[1])
            elif kind == "end_thinking":
                item[2](self._core.end_thinking(item[1]))
            elif kind == "suspend":
                self._command_suspend(item[1])
            elif kind == "resume":
                self._command_resume(item[1])
            elif kind == "close_session":
                item[2](self._core.close_session(item[1]))
            elif kind == "lora_load":
                item[3](self._load_lora(item[1], item[2]))
            elif kind == "lora_keep":
                item[2](self._core.keep_lora(item[1]))
            elif kind == "lora_unload":
                if self.state == "suspended":
                    item[2](ImpError("the engine is suspended; POST /admin/resume first", code="suspended",
                                     status=409))
                else:
                    if self.idle_suspended:
                        self._unpark("a LoRA adapter is unloading")
                    self._core.unload_lora(item[1], item[2])
            elif kind == "add":
                _, req, emit = item
                try:
                    if self.state == "faulted":
                        raise EngineError(self.error if self.error.startswith(PEER_LOST) else
                                          f"engine is faulted: {self.error}", code="engine_faulted")
                    if self.state == "suspended":
                        raise EngineError("the engine is suspended; POST /admin/resume", code="suspended",
                                          status=503)
                    self._last_request = time.monotonic()
                    if self.idle_suspended:
                        self._unpark("a request arrived")
                    self._core.add_request(req, emit)
                except ImpError as e:
                    emit(e)
                except Exception as e:  # never leave a caller waiting
                    log.exception("rejecting request %s", req.request_id)
                    emit(EngineError(str(e)))
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True
