"""Tensor parallelism across processes (hosts) on jax.distributed: one SPMD program, process 0 leads.

Every process loads the same model (placing only its own devices' shards), allocates the same KV
cache, and compiles and runs the same warm-up programs in the same order (no background compiles).
Then process 0 serves HTTP and schedules: before each program it runs (a step bucket, the prompt
scoring program) it broadcasts a header (which program) and that program's two packed input
buffers (runtime/execution/packing.py) with `multihost_utils.broadcast_one_to_all`, and every other process
runs the same executable on them. Idle, the leader broadcasts a no-op every PING_S, so a lost
process is found without waiting for a request. With `jax_enable_recoverability` a collective
with a dead peer raises at once (without it the coordination service aborts the survivor): the
leader's engine faults naming the lost process; a follower whose leader is gone exits.

Every device computation the engine makes, and how it stays in step across processes:
- KV cache zeros (builder), weights and cache `device_put` (CompiledStep): every process, at build;
- warm-up compiles and first runs of every step bucket and the score program: every process, in
  `CompiledStep.warm_up`'s order (background compilation and idle first runs are off);
- step (`launch`) and prompt scoring (`score`): announced here, run by all;
- suspend/resume (parking on the host), LoRA slots (`write_params`): refused with more than one
  process; embedding / rerank encoders run on process 0's own device, no collective.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import time
from typing import Any

import numpy as np

from imp_jax.runtime.config import EngineConfig

log = logging.getLogger("imp_jax.multihost")
HEARTBEAT_TIMEOUT_S = 10   # the coordinator counts a process silent this long as lost
PING_S = 2.0               # the idle leader's no-op broadcast period
NOOP, STEP, SCORE, STOP, TABLES = 0, 1, 2, 3, 4
PROGRAMS = {STEP: "step", SCORE: "score", TABLES: "tables"}   # TABLES: block-table edits (runtime/scheduling/block_tables.py)
PEER_LOST = "multi-host: process"   # how the engine error of a lost process starts (shown to clients)


def check_config(config: EngineConfig) -> None:
    """A ValueError for what a multi-host engine cannot do (checked before anything starts)."""
    refused = [(config.data_parallel_size > 1, "--data-parallel-size"),
               (bool(config.max_loras or config.lora), "LoRA adapters (--lora, --max-loras)"),
               (config.idle_unload_seconds > 0, "--idle-unload-seconds")]
    for bad, what in refused:
        if bad:
            raise ValueError(f"{what} cannot be combined with --num-processes {config.num_processes} (multi-host "
                             "tensor parallelism) yet")
    public = [] if config.coordinator_insecure_ok else public_addresses(coordinator_host(config.coordinator))
    if public:
        raise ValueError(f"--coordinator {config.coordinator} is not a private or loopback address "
                         f"({', '.join(public)}): the coordinator and the collectives are unauthenticated and "
                         "carry every prompt's token ids in the clear; run them on a private network, or pass "
                         "--coordinator-insecure-ok (docs/SECURITY.md)")


def coordinator_host(address: str) -> str:
    """The host of a HOST:PORT (an IPv6 address in brackets: [::1]:7777)."""
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def public_addresses(host: str) -> list[str]:
    """The addresses `host` names (a hostname resolved) that are not private (RFC 1918, fc00::/7, link-local)
    or loopback; the unspecified address (every interface) counts as public. A ValueError when it does
    not resolve: the check cannot pass on a name it cannot see."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError) as e:
        raise ValueError(f"--coordinator host {host!r} does not resolve: {e}") from None
    public = []
    for info in infos:
        address = str(info[4][0]).split("%", 1)[0]   # an IPv6 scope id: fe80::1%eth0
        ip = ipaddress.ip_address(address)
        ip = getattr(ip, "ipv4_mapped", None) or ip
        if ip.is_unspecified or not (ip.is_private or ip.is_loopback):
            public.append(address)
    return sorted(set(public))


def initialize(config: EngineConfig) -> None:
    """Join the process group (blocks until all --num-processes have joined); before any other JAX use."""
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")   # CPU collectives across processes
    jax.config.update("jax_enable_recoverability", True)   # a dead peer: collectives raise, no abort
    # process 0 listens on the address --coordinator names only (JAX's default binds every interface)
    jax.distributed.initialize(coordinator_address=config.coordinator, num_processes=config.num_processes,
                               process_id=config.process_id, heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
                               coordinator_bind_address=config.coordinator)
    n, local = jax.device_count(), jax.local_device_count()
    log.info("process %d of %d joined %s: %d devices in all, %d here", config.process_id, config.num_processes,
             config.coordinator, n, local)
    if config.tensor_parallel_size != n:
        raise ValueError(f"--tensor-parallel-size {config.tensor_parallel_size} must equal the devices of all "
                         f"{config.num_processes} processes: {n} ({local} on this one)")


def lost_processes(n: int, wait_s: float = HEARTBEAT_TIMEOUT_S + 2.0) -> list[int]:
    """The processes the coordinator no longer sees (polled up to `wait_s`: it may learn of a death after
    the collective that failed on it); [] when it sees them all or cannot be asked."""
    from jax._src import distributed
    deadline = time.monotonic() + wait_s
    while True:
        try:
            live = distributed.global_state.client.get_live_nodes(list(range(n)))
        except Exception:   # the coordinator itself is gone
            return []
        lost = [p for p in range(n) if p not in live]
        if lost or time.monotonic() >= deadline:
            return lost
        time.sleep(0.2)


class Leader:
    """Process 0's side: announce each program to the followers before running it."""

    def __init__(self, num_processes: int):
        self.num_processes = num_processes
        self._last = time.monotonic()

    def send(self, op: int, bucket: tuple[int, int, int] = (0, 0, 0), ints: np.ndarray | None = None,
             floats: np.ndarray | None = None) -> None:
        from jax.experimental.multihost_utils import broadcast_one_to_all
        if len(bucket) != 3:   # `follow` reads a header of exactly six ints
            raise ValueError(f"a program's bucket is (tokens, seqs, context), not {bucket}")
        sizes = (0, 0) if ints is None else (ints.size, floats.size)
        broadcast_one_to_all(np.asarray([op, *bucket, *sizes], np.int32))
        if ints is not None:
            broadcast_one_to_all((ints, floats))
        self._last = time.monotonic()

    def ping(self) -> None:
        """Idle: a no-op broadcast every PING_S (raises when a follower is gone)."""
        if time.monotonic() - self._last >= PING_S:
            self.send(NOOP)

    def stop(self) -> None:
        """Tell the followers to exit (best effort: at shutdown)."""
        try:
            self.send(STOP)
        except Exception as e:
            log.warning("multi-host: could not tell the other processes to stop: %s", e)

    def fault_message(self, error: BaseException) -> str:
        """The engine's error for a failed step: which process was lost, when the coordinator knows."""
        lost = lost_processes(self.num_processes)
        if not lost:
            return f"device fault: {error}"
        log.error("multi-host: lost process(es) %s: %s", lost, error)
        names = ", ".join(str(p) for p in lost)
        return (f"{PEER_LOST}{'es' if len(lost) > 1 else ''} {names} of {self.num_processes} lost "
                f"(no heartbeat, collectives fail); restart every process")


def follow(step_fn: Any) -> int:
    """A follower's loop: run what the leader announces until it says stop (0) or is lost (1)."""
    from jax.experimental.multihost_utils import broadcast_one_to_all
    header = np.zeros(6, np.int32)
    while True:
        try:
            op, T, S, C, n_int, n_float = (int(x) for x in broadcast_one_to_all(header))
            if op == STOP:
                log.info("multi-host: process 0 says stop")
                return 0
            if op == NOOP:
                continue
            ints, floats = broadcast_one_to_all((np.zeros(n_int, np.int32), np.zeros(n_float, np.float32)))
            step_fn.run_packed(PROGRAMS[op], (T, S, C), ints, floats)
        except Exception as e:
            log.error("multi-host: lost process 0 (or a peer); exiting: %s", e)
            return 1


def watch_leader(num_processes: int, period_s: float = HEARTBEAT_TIMEOUT_S / 2) -> threading.Thread:
    """A follower's watchdog: exit the process once the coordinator (process 0) is gone or no longer sees
    every process, even if a collective never returns (a host switched off closes no connection)."""
    def run() -> None:
        from jax._src import distributed
        while True:
            time.sleep(period_s)
            try:
                live = distributed.global_state.client.get_live_nodes(list(range(num_processes)))
                lost = [p for p in range(num_processes) if p not in live]
            except Exception as e:
                lost, why = [0], str(e)
            else:
                why = "no heartbeat"
            if lost:
                log.error("multi-host: process(es) %s lost (%s); exiting", lost, why)
                logging.shutdown()
                os._exit(1)

    thread = threading.Thread(target=run, name="imp-multihost-watchdog", daemon=True)
    thread.start()
    return thread


def run_follower(config: EngineConfig) -> int:
    """Process != 0: build the same engine (no HTTP server), then run the leader's steps; the exit code."""
    from imp_jax.runtime.core.builder import build_engine
    watch_leader(config.num_processes)
    try:
        core = build_engine(config)   # every program compiled and run once, in the leader's order
    except Exception as e:
        log.exception("process %d failed to start: %s", config.process_id, e)
        code = 1
    else:
        log.info("process %d ready: following process 0", config.process_id)
        code = follow(core.step_fn)
    logging.shutdown()
    os._exit(code)   # no exit barrier with a group that may be gone
