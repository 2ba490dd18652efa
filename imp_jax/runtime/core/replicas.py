"""EngineReplicas: D AsyncEngines on disjoint devices behind the AsyncEngine's own interface (data parallelism).

Each replica has its own weights, KV pool, scheduler and engine thread; the server holds this in
place of one engine only when --data-parallel-size is above 1. A request goes to the replica it
is bound to (its session's), else to the one whose prefix cache holds the longest prefix of its
prompt's blocks (unless that replica is busier than the least loaded by more than a quarter of a
batch), else to the least loaded (rows in flight, plus prompt tokens not yet prefilled counted
in steps' worth); ties rotate. Commands for every replica (suspend, resume, LoRA load) go to all.
The state is the worst replica's: one faulted replica makes the whole server report faulted.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
from collections import OrderedDict
from typing import Any, AsyncIterator, Callable

from imp_jax.errors import ImpError
from imp_jax.runtime.api import Engine, not_serving
from imp_jax.runtime.core.async_engine import AsyncEngine, capabilities_of
from imp_jax.runtime.config import EngineConfig
from imp_jax.runtime.kv.kv_hash import prefix_hashes
from imp_jax.runtime.request import EngineEvent, GenerationRequest, ImageInput, StreamLimits

STATE_ORDER = ("faulted", "stopped", "loading", "warming_up", "suspended", "ready")   # worst first
MAX_SESSIONS = 65536   # session ids remembered for stickiness (least recently used forgotten first)
MAX_KEYS = ("kv_block_size", "decode_batch_max", "kv_pool_floored", "kv_min_swap_tokens")   # not summed over replicas


def make_engine(config: EngineConfig) -> Any:
    """One AsyncEngine, or EngineReplicas when config.data_parallel_size > 1 (the server holds either)."""
    if config.data_parallel_size == 1:
        return AsyncEngine(config)
    check_devices(config)
    return EngineReplicas(config)


def check_devices(config: EngineConfig) -> None:
    """A ValueError (saying how to get fake CPU devices) unless this host has the devices every replica needs."""
    if config.multi_host:   # every process's devices: runtime/multihost.initialize checked them
        return
    if config.data_parallel_size > 1 or config.tensor_parallel_size > 1:
        from imp_jax.runtime.parallel.sharding import replica_devices
        replica_devices(config.data_parallel_size - 1, config.data_parallel_size, config.tensor_parallel_size)


def _device_of(engine: AsyncEngine) -> str | None:
    """The replica's device, as JAX names it (cpu:1, cuda:0), once it has loaded."""
    try:
        return str(engine.core.step_fn.mesh.devices.flat[0])
    except Exception:   # still loading
        return None


@dataclasses.dataclass
class _Load:
    """What the router has sent a replica and not seen end: rows (n per request) and unprefilled prompt tokens."""

    rows: int = 0
    pending_tokens: int = 0
    routed: int = 0   # requests routed here since start

    def score(self, tokens_per_step: int) -> float:
        return self.rows + self.pending_tokens / tokens_per_step


def _same_on_every_replica(name: str) -> property:
    """A read-only attribute every replica has alike (the model's): replica 0's."""
    return property(lambda self: getattr(self.replicas[0], name), doc=f"replica 0's {name}")


class EngineReplicas(Engine):
    """The AsyncEngine's interface over `config.data_parallel_size` replicas (module docstring)."""

    def __init__(self, config: EngineConfig, build: Callable[[int], AsyncEngine] | None = None):
        self.config = config
        self.capabilities = dataclasses.replace(capabilities_of(config), replicas=True)
        count = config.data_parallel_size
        self.replicas: list[AsyncEngine] = [(build or (lambda i: AsyncEngine(config, replica=i)))(i)
                                            for i in range(count)]
        self._loads = [_Load() for _ in self.replicas]
        self._owner: dict[str, int] = {}                          # request id -> replica, while it runs
        self._sessions: OrderedDict[str, int] = OrderedDict()     # session id -> replica (sticky)
        self._turn = itertools.count()                            # rotates ties between equal replicas
        self._slack = max(1, config.max_num_seqs // 4)

    # --------------------------------------------------------------- lifecycle
    def start(self) -> None:
        for r in self.replicas:
            r.start()

    async def wait_ready(self) -> None:
        await asyncio.gather(*(r.wait_ready() for r in self.replicas))

    def shutdown(self, timeout: float = 10.0) -> None:
        threads = [threading.Thread(target=r.shutdown, args=(timeout,), daemon=True) for r in self.replicas]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    @property
    def state(self) -> str:
        states = [r.state for r in self.replicas]
        return next((s for s in STATE_ORDER if s in states), states[0])

    @property
    def error(self) -> str | None:
        errors = ((i, r.error) for i, r in enumerate(self.replicas))
        return next((f"replica {i}: {e}" for i, e in errors if e), None)

    @property
    def progress(self) -> float:
        return min(r.progress for r in self.replicas)

    @property
    def idle_suspended(self) -> bool:
        return any(r.idle_suspended for r in self.replicas)

    def replica_states(self) -> list[str]:
        return [r.state for r in self.replicas]

    # ------------------------------------------------------------------- model (the same on every replica)
    core = _same_on_every_replica("core")
    tokenizer = _same_on_every_replica("tokenizer")
    served_name = _same_on_every_replica("served_name")
    max_model_len = _same_on_every_replica("max_model_len")
    vocab_size = _same_on_every_replica("vocab_size")
    model_config = _same_on_every_replica("model_config")
    dtype = _same_on_every_replica("dtype")
    device = _same_on_every_replica("device")
    default_params = _same_on_every_replica("default_params")
    vision = _same_on_every_replica("vision")
    reply_markers = _same_on_every_replica("reply_markers")

    def image_prompt(self, image: ImageInput) -> str:
        return self.replicas[0].image_prompt(image)

    @property
    def max_num_seqs(self) -> int:
        """Sequences the replicas run at once, together (/props total_slots, /info)."""
        return self.config.max_num_seqs * len(self.replicas)

    def stats(self) -> dict[str, Any]:
        """Every replica's stats summed (MAX_KEYS: the largest), and each replica's own under `replicas`."""
        per = []
        for i, (r, load) in enumerate(zip(self.replicas, self._loads)):
            one = r.stats()
            one.update(replica=i, state=r.state, requests_routed=load.routed, routed_rows=load.rows,
                       device=_device_of(r))
            per.append(one)
        total: dict[str, Any] = {"state": self.state, "suspended": self.state == "suspended",
                                 "idle_suspended": self.idle_suspended,
                                 "idle_unload_seconds": self.config.idle_unload_seconds,
                                 "data_parallel_size": len(self.replicas)}
        for key in dict.fromkeys(k for one in per for k in one):   # a replica still loading has no counters yet
            values = [one.get(key, 0) for one in per]
            if key in total or key == "replica" or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                           for v in values):
                continue
            total[key] = max(values) if key in MAX_KEYS else sum(values)
        total["replicas"] = per
        return total

    # ---------------------------------------------------------------- routing
    def route(self, req: GenerationRequest) -> int:
        """The replica for `req` (module docstring); binds its session to it."""
        session = req.session_id
        if session is not None and session in self._sessions:
            self._sessions.move_to_end(session)
            return self._sessions[session]
        per_step = max(1, self.config.max_num_batched_tokens)
        scores = [load.score(per_step) for load in self._loads]
        ready = [i for i, r in enumerate(self.replicas) if r.state == "ready"] or list(range(len(self.replicas)))
        least = min(scores[i] for i in ready)
        hits = self.cached_blocks(req, ready)
        best = max(hits[i] for i in ready)
        pool = [i for i in ready if hits[i] == best and scores[i] <= least + self._slack] if best else []
        pool = pool or [i for i in ready if scores[i] == least]
        turn = next(self._turn)
        choice = pool[turn % len(pool)]
        if session is not None:
            self._sessions[session] = choice
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        return choice

    def cached_blocks(self, req: GenerationRequest, replicas: list[int]) -> dict[int, int]:
        """How many leading prompt blocks of `req` each of `replicas` has cached. The hashes are computed
        once per distinct prefix-cache key and only while some replica still holds the chain."""
        keys: dict[int, Any] = {}
        for i in replicas:
            try:
                keys[i] = self.replicas[i].prefix_key(req)
            except (KeyError, ImpError):   # its adapter is not loaded there, or it is not loaded yet
                pass
        hits = {i: 0 for i in replicas}
        groups: dict[Any, list[int]] = {}
        for i, key in keys.items():
            groups.setdefault(key, []).append(i)
        for key, members in groups.items():
            live = members
            for h in prefix_hashes(req.prompt_ids, self.config.block_size, key):
                live = [i for i in live if self.replicas[i].holds_block(h)]
                if not live:
                    break
                for i in live:
                    hits[i] += 1
        return hits

    # ---------------------------------------------------------------- requests
    async def generate(self, req: GenerationRequest, limits: StreamLimits = StreamLimits(),
                       on_stall: Callable[[], None] | None = None) -> AsyncIterator[EngineEvent]:
        """The routed replica's events for `req` (AsyncEngine.generate)."""
        if self.state != "ready":   # as one engine would refuse it: the worst replica's state
            raise not_serving(self.state, self.error)
        i = self.route(req)
        load = self._loads[i]
        rows, pending = req.params.n, len(req.prompt_ids)
        load.rows += rows
        load.pending_tokens += pending
        load.routed += 1
        self._owner[req.request_id] = i
        try:
            async for ev in self.replicas[i].generate(req, limits, on_stall):
                if pending:   # the first event: its prompt is prefilled
                    load.pending_tokens -= pending
                    pending = 0
                yield ev
        finally:
            load.rows -= rows
            load.pending_tokens -= pending
            self._owner.pop(req.request_id, None)

    def cancel(self, request_id: str) -> None:
        """Cancel on the replica running it; one the router no longer knows is told to all (a no-op there)."""
        i = self._owner.get(request_id)
        for r in self.replicas if i is None else [self.replicas[i]]:
            r.cancel(request_id)

    async def end_thinking(self, request_id: str) -> str:
        i = self._owner.get(request_id)
        return "unknown" if i is None else await self.replicas[i].end_thinking(request_id)

    async def close_session(self, session_id: str) -> bool:
        """Release the session's pins on its replica (on every replica if it is not known here)."""
        i = self._sessions.pop(session_id, None)
        targets = self.replicas if i is None else [self.replicas[i]]
        return any(await asyncio.gather(*(r.close_session(session_id) for r in targets)))

    async def suspend(self) -> dict[str, Any]:
        """Every replica suspends; faulted if any is, already_suspended if all were."""
        answers, status = await self._on_every_replica(lambda r: r.suspend(), "already_suspended")
        if status:
            return {"status": status}
        return {"status": "suspended", "freed_bytes": sum(a.get("freed_bytes", 0) for a in answers)}

    async def resume(self) -> dict[str, Any]:
        _, status = await self._on_every_replica(lambda r: r.resume(), "not_suspended")
        return {"status": status or "resumed"}

    async def _on_every_replica(self, command: Callable[[AsyncEngine], Any],
                                unchanged: str) -> tuple[list[dict[str, Any]], str | None]:
        """Every replica's answer to `command`, and the status that speaks for all of them: faulted if
        any replica is, `unchanged` if every replica answered it; None when the command took effect."""
        answers = await asyncio.gather(*(command(r) for r in self.replicas))
        statuses = {a["status"] for a in answers}
        if "faulted" in statuses:
            return answers, "faulted"
        return answers, unchanged if statuses == {unchanged} else None

    async def load_lora(self, name: str, path: str) -> dict[str, Any]:
        """Load the adapter on every replica; if one refuses, those that took it unload it again."""
        results = await asyncio.gather(*(r.load_lora(name, path) for r in self.replicas), return_exceptions=True)
        failed = next((e for e in results if isinstance(e, BaseException)), None)
        if failed is None:
            return next(res for res in results if not isinstance(res, BaseException))
        loaded = [r for r, res in zip(self.replicas, results) if not isinstance(res, BaseException)]
        await asyncio.gather(*(r.unload_lora(name) for r in loaded), return_exceptions=True)
        raise failed

    async def unload_lora(self, name: str, timeout_s: float | None = None) -> dict[str, Any] | None:
        """Unload the adapter on every replica; if one refuses (its requests outlast `timeout_s`), those
        that unloaded it load it again from its path, so every replica keeps serving the same adapters."""
        results = await asyncio.gather(*(r.unload_lora(name, timeout_s) for r in self.replicas),
                                       return_exceptions=True)
        failed = next((e for e in results if isinstance(e, BaseException)), None)
        if failed is None:
            return next((res for res in results if isinstance(res, dict)), None)
        unloaded = [(r, res) for r, res in zip(self.replicas, results) if isinstance(res, dict)]
        await asyncio.gather(*(r.load_lora(name, res["path"]) for r, res in unloaded), return_exceptions=True)
        raise failed

    def lora_adapters(self) -> list[dict[str, Any]]:
        return self.replicas[0].lora_adapters()
