"""What a server starts before it imports jax (runtime/core/replicas.py and the engine behind it): the first
start's C++ kernel builds, which then run beside that import, the model fetch and its opening.
This module and what it imports stay free of jax."""
from __future__ import annotations

import threading

from imp_jax.kernels_pallas.cpu import build as cpu_kernels
from imp_jax.runtime.config import EngineConfig


def start_kernel_builds(config: EngineConfig) -> list[threading.Thread]:
    """Start building the CPU kernel libraries `config`'s engine will load, where it will run on this CPU
    (cpu/build.py `start_early`); the engine's own request for them then waits for these builds."""
    if config.multi_host:
        return []
    return cpu_kernels.start_early(config.attention, config.gemm, config.max_loras > 0)
