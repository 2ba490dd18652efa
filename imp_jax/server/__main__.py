"""`python -m imp_jax.server`: listen at once, load and warm up the model behind it, exit cleanly on a signal."""
from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import prometheus_client
from hypercorn.asyncio import serve
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from quart import Quart

from imp_jax.errors import ImpError
from imp_jax.runtime.api import Encoder, Engine
from imp_jax.runtime.config import EngineConfig
from imp_jax.runtime.core.early_start import start_kernel_builds
from imp_jax.server.app import create_app
from imp_jax.server.cli import parse_config
from imp_jax.server.context import ServerConfig, state_of
from imp_jax.server.encoders import encoders_of, install_encoders
from imp_jax.server.models_dir import ModelDirectory, NoModel, in_flight

log = logging.getLogger("imp_jax.server")
UNSENT_LOWAT = 128 * 1024  # bytes of a response the kernel holds for a client that is not reading


class _HypercornConfig(HypercornConfig):
    """Hypercorn's config; its TCP sockets keep at most UNSENT_LOWAT unsent bytes (TCP_NOTSENT_LOWAT, where
    the OS has it), so a client that stops reading a stream blocks the server's writes after ~100 KiB
    instead of after the kernel's autotuned send buffer (MiBs), and the stall timeout can see it."""

    bound: Sockets | None = None   # made by `listen` before the model loads; hypercorn then serves on them

    def listen(self) -> None:
        """Bind now, so a port in use is a start-up error before a minute of model loading."""
        self.bound = self.create_sockets()

    def create_sockets(self) -> Sockets:
        if self.bound is not None:
            sockets, self.bound = self.bound, None
            return sockets
        sockets = super().create_sockets()
        option = getattr(socket, "TCP_NOTSENT_LOWAT", None)
        for sock in (*sockets.secure_sockets, *sockets.insecure_sockets):
            if option is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, option, UNSENT_LOWAT)
        return sockets


LOAD_FAILED = 1   # the exit code when the start-up model cannot be loaded
CANNOT_LISTEN = 2   # ... when the address is taken or not ours to bind (before loading anything)


async def run(app: Quart, engine: Engine, config: ServerConfig) -> int:
    """Serve until SIGINT or SIGTERM; then new requests get 503 draining while the in-flight ones finish
    (at most --drain-timeout seconds; a second signal stops waiting), and the process exits 0. A model
    that fails to load at start-up (a bad path, a corrupt file) stops the server at once with exit
    code 1, as llama-server and vLLM do, instead of serving 503s that no restart policy notices."""
    hc = _HypercornConfig()
    hc.bind = [f"{config.host}:{config.port}"]
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.graceful_timeout = 5.0
    stop, stop_now = asyncio.Event(), asyncio.Event()   # the first signal drains; a second stops waiting
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: (stop_now if stop.is_set() else stop).set())

    async def shutdown_trigger() -> None:
        await stop.wait()
        state_of(app).draining = True   # new generation requests: 503 draining; /ready 503 draining
        busy = busy_requests(app)
        log.info("shutting down: finishing %d in-flight request(s), at most %.0f s", busy, config.drain_timeout)
        deadline = loop.time() + config.drain_timeout
        while busy and loop.time() < deadline and not stop_now.is_set():
            await asyncio.sleep(0.1)
            busy = busy_requests(app)
        if busy:
            log.warning("shutting down with %d request(s) unfinished after %.0f s", busy, config.drain_timeout)

    try:
        hc.listen()
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", config.host, config.port, e.strerror or e)
        return CANNOT_LISTEN
    failed: list[str] = []

    async def watch_load() -> None:
        try:
            await engine.wait_ready()
        except ImpError as e:
            failed.append(e.message)
            log.error("the model failed to load, exiting: %s", e.message)
            stop_now.set()
            stop.set()

    engine.start()
    watcher = None if isinstance(engine, NoModel) else asyncio.create_task(watch_load())
    try:
        await serve(app, hc, shutdown_trigger=shutdown_trigger)
    finally:
        if watcher is not None:
            watcher.cancel()
        state_of(app).engine.shutdown(timeout=2.0)  # a model still loading cannot be interrupted (daemon thread)
        log.info("stopped")
    return LOAD_FAILED if failed else 0


def busy_requests(app: Quart) -> int:
    """Requests the chat engine and the encoder engines hold: what a drain waits for."""
    return in_flight(state_of(app).engine) + sum(e.in_flight for e in encoders_of(app).values())


MALLOC_ARENAS = 2  # glibc's default is 8 per core, each grown to its thread's high-water mark


def limit_malloc_arenas() -> bool:
    """Cap glibc's malloc arenas (unless MALLOC_ARENA_MAX says otherwise) before any thread starts.

    With the default, the server's many threads (engine, XLA's pool, executors) each fill an arena
    of their own: a mixed load grew resident memory ~5% over its first two minutes before levelling
    off; capped at 2 it stayed flat (docs/PERF.md, soak). Not glibc (musl, macOS): nothing to do.
    """
    if os.environ.get("MALLOC_ARENA_MAX") or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_arena_max = -8  # from glibc's malloc.h
    return mallopt(m_arena_max, MALLOC_ARENAS) == 1


def main(argv: list[str] | None = None) -> int:
    limit_malloc_arenas()
    config = parse_config(argv, EngineConfig)
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prometheus_client.disable_created_metrics()  # process-wide: no `_created` twin of every counter on /metrics
    if config.engine.multi_host:   # jax.distributed before any other JAX use; processes != 0 serve no HTTP
        code = start_multi_host(config)
        if code is not None:
            return code
    start_kernel_builds(config.engine)   # a first start's C++ kernel builds run beside the jax import below
    from imp_jax.runtime.core.replicas import check_devices  # the engine (and jax) live behind this import
    from imp_jax.runtime.core.replicas import make_engine as engine_for

    models_dir = Path(config.models_dir) if config.models_dir else None
    if models_dir is not None and not models_dir.is_dir():
        print(f"python -m imp_jax.server: error: --models-dir {models_dir}: not a directory", file=sys.stderr)
        return 2
    # with --models-dir and no --model, start empty: the first request (or /admin/models/load) names one
    if models_dir is not None and not config.model_given and config.engine.lora:
        print("python -m imp_jax.server: error: --lora needs --model: start-up adapters belong to the model "
              "started with (with --models-dir, load adapters with POST /admin/lora/load)", file=sys.stderr)
        return 2
    try:
        check_devices(config.engine)
        engine = NoModel() if models_dir is not None and not config.model_given else engine_for(config.engine)
    except ValueError as e:   # --data-parallel-size beyond the devices there are
        print(f"python -m imp_jax.server: error: {e}", file=sys.stderr)
        return 2
    try:
        app = create_app(engine, config)
    except ValueError as e:  # what only the app can check: the request log's file
        print(f"python -m imp_jax.server: error: {e}", file=sys.stderr)
        return 2
    if models_dir is not None:
        def make_engine(path: Path) -> Engine:   # start-up adapters and projector belong to the start-up model
            return engine_for(dataclasses.replace(config.engine, model=str(path), lora=[], mmproj=None))

        current = Path(config.engine.model) if config.model_given else None
        state_of(app).models = ModelDirectory(models_dir, make_engine, config.swap_timeout, current,
                                               min_residency_s=config.swap_min_seconds)
    try:
        install_encoders(app, make_encoders(config))
    except (ImpError, ValueError) as e:   # a missing or unsupported embedding / rerank model
        print(f"python -m imp_jax.server: error: {getattr(e, 'message', e)}", file=sys.stderr)
        return 2
    return asyncio.run(run(app, engine, config))


def start_multi_host(config: ServerConfig) -> int | None:
    """Join the process group (--coordinator); None on process 0, which goes on to serve HTTP; the others
    follow its steps here and return their exit code (docs/DEPLOYMENT.md, tensor parallel across hosts)."""
    from imp_jax.runtime.parallel.multihost import check_config, initialize, run_follower

    try:
        if config.models_dir:
            raise ValueError("--models-dir cannot be combined with --num-processes > 1 (multi-host) yet")
        check_config(config.engine)
        initialize(config.engine)
    except ValueError as e:
        print(f"python -m imp_jax.server: error: {e}", file=sys.stderr)
        return 2
    if config.engine.process_id == 0:
        return None
    return run_follower(config.engine)


def make_encoders(config: ServerConfig) -> list[Encoder]:
    """The EncoderEngines of --embedding-model and --rerank-model (not started; the app starts them)."""
    from imp_jax.runtime.core.encoder_engine import EncoderEngine, EncoderEngineConfig

    chat = None if not config.model_given and config.models_dir else Path(str(config.engine.model)).name
    out = []
    for path in (config.embedding_model, config.rerank_model):
        if path:
            engine = EncoderEngine(EncoderEngineConfig(path, max_batch=config.encoder_max_batch,
                                                       dtype=config.engine.dtype,
                                                       compilation_cache_dir=config.engine.compilation_cache_dir))
            if engine.served_name == chat:
                raise ValueError(f"the encoder model '{engine.served_name}' has the chat model's name")
            out.append(engine)
    return out


if __name__ == "__main__":
    sys.exit(main())
