"""AsyncEngine: the asyncio face of the engine core, which runs on its own thread.

Requests and commands go in through the inbox as dataclasses (commands.py; the thread, the inbox
and the answers are EngineThread's); events come back to each request's bounded EventBuffer via
`call_soon_threadsafe`, so the engine thread never waits for a reader, and a reader that stops
reading is dropped (event_buffer.py). The core fails only the requests a failed step touches
(runtime/core/step_failures.py); a device fault that reaches this thread marks the engine faulted and
fails every request in flight with an error event.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from typing import Any, AsyncIterator, Callable

from imp_jax.errors import EngineError, ImpError, InvalidRequestError
from imp_jax.runtime.api import Capabilities, Engine, not_serving, not_supported
from imp_jax.runtime.core.commands import (AddRequest, Cancel, CloseSession, Command, EndThinking, KeepLora, LoadLora,
                                      Reply, Resume, Suspend, UnloadLora)
from imp_jax.runtime.config import EngineConfig
from imp_jax.runtime.defaults import model_defaults
from imp_jax.runtime.core.engine import EngineCore
from imp_jax.runtime.core.engine_thread import EngineThread, to_loop
from imp_jax.runtime.features.images import image_keys
from imp_jax.runtime.features.think import ThinkFeature
from imp_jax.runtime.decoding.image_family import image_family
from imp_jax.runtime.core.event_buffer import EventBuffer
from imp_jax.runtime.parallel.multihost import PEER_LOST
from imp_jax.runtime.replies.harmony import ReplyMarkers
from imp_jax.runtime.request import EngineEvent, GenerationRequest, ImageInput, StreamLimits

log = logging.getLogger("imp_jax.engine")


def capabilities_of(config: EngineConfig) -> Capabilities:
    """What an engine of `config` offers: LoRA with slots (--max-loras), suspend on one host only."""
    return Capabilities(lora=config.max_loras > 0, sessions=True, suspend=not config.multi_host, end_thinking=True)


class AsyncEngine(EngineThread, Engine):
    """Start with `start()`; `generate()` streams EngineEvents; `cancel()` frees a request's blocks."""

    # parked for idleness: still "ready", the next request resumes (class-level: the Engine protocol's fact)
    idle_suspended: bool = False

    def __init__(self, config: EngineConfig, build: Callable[..., EngineCore] | None = None, replica: int = 0):
        super().__init__("imp-engine" + (f"-{replica}" if replica else ""), "engine", log)
        self.config = config
        self.replica = replica          # its device group of config.data_parallel_size (runtime/core/replicas.py)
        self.capabilities = capabilities_of(config)
        self.progress = 0.0
        self._build = build
        self._core: EngineCore | None = None
        self._compiler: threading.Thread | None = None   # background compiles (builder.compile_in_background)
        self._compiler_lock = threading.Lock()
        self._stopping = False
        self._suspend_waiters: list[Reply] = []
        self._last_request = 0.0

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._compiler_lock:
            self._stopping = True
        super().shutdown(timeout)
        if self._compiler is not None:   # a compile cut off by the interpreter's exit aborts the process
            self.core.step_fn.stop_compiling()
            self._compiler.join(max(timeout, 60.0))
        if self._core is not None and self._core.tiers is not None:
            try:   # the disk tier keeps the cached prefixes (bounded wait)
                self._core.tiers.close(self._core.pool if self.state != "faulted" else None)
            except Exception:   # a device that faulted meanwhile: the queued writes are all it keeps
                self._log.exception("closing the KV tiers failed")

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
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    @property
    def vision(self) -> bool:
        """Whether the loaded model has an image side (model/vision/): it takes `GenerationRequest.images`."""
        return self.core.loaded.vision is not None

    def image_prompt(self, image: ImageInput) -> str:
        """The text standing for `image` in a prompt, from its size alone, by family (runtime/decoding/image_family.py):
        Idefics3 its tiles' and global image's special tokens with image_seq_len `<image>` tokens per frame;
        Qwen2.5-VL `<|vision_start|>`, one `<|image_pad|>` per row, `<|vision_end|>`; Gemma 3 `\n\n<start_of_image>`,
        mm_tokens_per_image `<image_soft_token>`s, `<end_of_image>\n\n`."""
        vision = self.core.loaded.vision
        if vision is None:
            raise not_supported("image input")
        return image_family(vision).prompt(image.size)

    @property
    def reply_markers(self) -> ReplyMarkers | None:
        """Found once at load by the think feature, which splits the replies with them (runtime/features/think.py)."""
        think = self.core.by_name["reasoning"]
        assert isinstance(think, ThinkFeature)
        return think.markers

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
            raise not_serving(self.state, self.error)
        loop = asyncio.get_running_loop()
        reader = asyncio.current_task()
        await loop.run_in_executor(None, self.core.prepare, req)   # unbounded work (grammars): never on the engine thread

        def stalled() -> None:
            log.warning("request %s: the client read nothing for %.0f s with %d events waiting; dropped",
                        req.request_id, limits.stall_timeout_s, limits.max_events)
            self.cancel(req.request_id)
            if on_stall is not None:
                on_stall()
            if reader is not None:
                reader.cancel()

        events = EventBuffer(limits, stalled)
        self._submit(AddRequest(req, to_loop(loop, events.put, gone=lambda: self.cancel(req.request_id))))
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
        self._inbox.put(Cancel(request_id))   # never refused: after shutdown there is nothing to cancel

    async def end_thinking(self, request_id: str) -> str:
        """End the request's think block (EngineCore.end_thinking), answered by the engine thread."""
        return await self._ask(EndThinking(request_id))

    async def suspend(self) -> dict[str, Any]:
        """Operator suspend: refuse new requests (503 suspended), let those in flight finish, then park
        the weights and KV cache in host memory. Sticky until `resume()`. Not multi-host (capabilities)."""
        if not self.capabilities.suspend:   # the other processes' shards cannot be parked from here
            raise not_supported("suspend with --num-processes > 1 (multi-host)")
        return await self._ask(Suspend())

    async def resume(self) -> dict[str, Any]:
        """Put the parked weights and KV cache back on the device and take requests again."""
        return await self._ask(Resume())

    async def close_session(self, session_id: str) -> bool:
        """Release a session's pinned KV blocks (runtime/scheduling/sessions.py); whether it was open."""
        return await self._ask(CloseSession(session_id))

    async def load_lora(self, name: str, path: str) -> dict[str, Any]:
        """Read the PEFT adapter at `path` (off the engine thread), then put it in a free slot under `name`
        (runtime/scheduling/lora.py); an ImpError says why not (400 bad adapter, 409 name taken or slots full)."""
        core = self.core
        if core.loras is None:
            raise InvalidRequestError("this server has no LoRA adapter slots; start it with --max-loras N",
                                      code="lora_disabled", param="name")
        adapter = await asyncio.get_running_loop().run_in_executor(None, core.loras.read, path)
        return await self._ask(LoadLora(name, adapter))

    async def unload_lora(self, name: str, timeout_s: float | None = None) -> dict[str, Any] | None:
        """Free adapter `name`'s slot once the requests using it end (new ones are refused meanwhile);
        its description, or None when no adapter has that name. Past `timeout_s` with requests still
        using it, the unload is called off, the adapter serves again, and a 503 lora_unload_timeout says so."""
        answer = self._ask_future(UnloadLora(name))
        try:
            return await asyncio.wait_for(asyncio.shield(answer), timeout_s)
        except asyncio.TimeoutError:
            active = await self._ask(KeepLora(name))
            if active is not None:
                raise ImpError(f"LoRA adapter '{name}' is still used by {active} request(s) after {timeout_s:g} s; "
                               "it stays loaded (retry later, or with a longer 'timeout_s')",
                               code="lora_unload_timeout", status=503, param="timeout_s") from None
            return await answer   # it finished meanwhile: the unload's own answer is on its way

    def prefix_key(self, req: GenerationRequest) -> Any:
        """The prefix-cache extra key `req`'s blocks get here (Sequence.cache_key); KeyError when its LoRA
        adapter is not loaded here. Read from another thread (a dict lookup), for routing only."""
        if not req.lora:
            return image_keys(req.cache_salt, req, self.core.loaded.vision)
        if self.core.loras is None:
            raise KeyError(req.lora)
        return image_keys((req.cache_salt, "lora", *self.core.loras.by_name[req.lora].cache_key), req,
                          self.core.loaded.vision)

    def holds_block(self, block_hash: bytes) -> bool:
        """Whether this engine's prefix cache holds a block of that hash (KVBlockPool.holds; any thread)."""
        return self._core is not None and self._core.pool.holds(block_hash)

    def lora_adapters(self) -> list[dict[str, Any]]:
        """The loaded adapters (name, id, path, slot, rank, target_modules); [] without slots."""
        core = self._core
        return list(core.loras.describe()) if core is not None and core.loras is not None else []

    # ------------------------------------------------------------ engine thread
    def _load(self) -> None:
        from imp_jax.runtime.core.builder import build_engine, compile_in_background

        def progress(phase: str, frac: float) -> None:
            self.state = phase if phase != "ready" else self.state
            self.progress = frac

        build = self._build or functools.partial(build_engine, background_compile=True, replica=self.replica)
        self._core = core = build(self.config, progress)
        if core.tiers is not None:
            core.tiers.wake = self.wake   # a disk read that lands ends the loop's wait (_loop)
        with self._compiler_lock:
            if not core.step_fn.warm and not self._stopping:
                self._compiler = compile_in_background(core)

    def _serve(self) -> None:
        import jax
        core = self.core
        leader = core.step_fn.leader   # multi-host process 0 (runtime/parallel/multihost.py)
        try:
            with jax.default_device(core.step_fn.mesh.devices.flat[0]):   # what this thread makes: its device
                self._loop(core)
        finally:
            if leader is not None and self.state != "faulted":
                leader.stop()

    def _loop(self, core: EngineCore) -> None:
        self._last_request = time.monotonic()
        while True:
            warming = not core.has_work() and core.step_fn.has_unrun()
            # idle, or only disk reads can make progress: wait for a command (a landed read posts one)
            if not self._drain(block=(not core.has_work() or core.waiting_for_reads()) and not warming):
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
                log.exception("device fault: the engine is faulted; failing every request")
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
        freed = 0 if self.core.step_fn.suspended else self.core.step_fn.suspend()
        if why == "idle":
            self.idle_suspended = True
        log.info("suspended (%s): %.0f MiB of weights and KV cache moved to host memory in %.2f s",
                 why, freed / 2**20, time.perf_counter() - t0)
        waiters, self._suspend_waiters = self._suspend_waiters, []
        for reply in waiters:
            reply({"status": "suspended", "freed_bytes": freed})

    def _unpark(self, why: str) -> None:
        t0 = time.perf_counter()
        if self.core.step_fn.suspended:
            self.core.step_fn.resume()
            log.info("resumed (%s) in %.2f s", why, time.perf_counter() - t0)
        self.idle_suspended = False

    def _apply(self, command: Command) -> None:
        """Engine thread: one command from the inbox, dispatched by its type."""
        core = self.core
        match command:
            case AddRequest(req=req, emit=emit):
                self._add(req, emit)
            case Cancel(request_id=request_id):
                core.cancel(request_id)
            case EndThinking(request_id=request_id):
                command.answer(core.end_thinking(request_id))
            case CloseSession(session_id=session_id):
                command.answer(core.close_session(session_id))
            case Suspend():
                self._suspend(command)
            case Resume():
                command.answer(self._resume())
            case LoadLora(name=name, adapter=adapter):
                self._refuse_unless_serving("LoRA adapter is loading")
                command.answer(core.load_lora(name, adapter))
            case UnloadLora(name=name):
                self._refuse_unless_serving("LoRA adapter is unloading")
                core.unload_lora(name, command.answer)   # answered once the adapter's requests ended
            case KeepLora(name=name):
                command.answer(core.keep_lora(name))
            case _:
                raise TypeError(f"the engine has no command {type(command).__name__}")

    def _add(self, req: GenerationRequest, emit: Reply) -> None:
        if self.state == "faulted":
            error = self.error or ""
            raise EngineError(error if error.startswith(PEER_LOST) else f"engine is faulted: {error}",
                              code="engine_faulted")
        if self.state == "suspended":
            raise EngineError("the engine is suspended; POST /admin/resume", code="suspended", status=503)
        self._last_request = time.monotonic()
        if self.idle_suspended:
            self._unpark("a request arrived")
        self.core.add_request(req, emit)

    def _refuse_unless_serving(self, why: str) -> None:
        """A LoRA change needs the weights on the device: 409 while suspended by the operator, resumed if idle."""
        if self.state == "suspended":
            raise ImpError("the engine is suspended; POST /admin/resume first", code="suspended", status=409)
        if self.state == "faulted":
            raise EngineError(f"engine is faulted: {self.error}")
        if self.idle_suspended:
            self._unpark(f"a {why}")

    def _suspend(self, command: Suspend) -> None:
        if self.state == "faulted":
            command.answer({"status": "faulted"})
        elif self.state == "suspended" and not self._suspend_waiters:
            command.answer({"status": "already_suspended"})
        else:
            self.state = "suspended"   # new requests: 503 suspended; those in flight finish first (_loop)
            self._suspend_waiters.append(command.answer)

    def _resume(self) -> dict[str, Any]:
        if self.state != "suspended":
            return {"status": "faulted" if self.state == "faulted" else "not_suspended"}
        for waiting in self._suspend_waiters:   # a suspend still draining is called off
            waiting({"status": "resumed_before_parking"})
        self._suspend_waiters = []
        self._unpark("operator")
        self._last_request = time.monotonic()
        self.state = "ready"
        return {"status": "resumed"}
