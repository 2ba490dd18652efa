"""The float32 projection GEMM for x86-64 CPUs (cpu_gemm.cc), built on first use and called as an
XLA FFI custom call; everywhere else, and whenever it cannot be built, XLA's own dot.

`matmul_wt(x, w)` is x @ w.T for w in [out, in] layout. When JAX's default backend is a CPU with
AVX2 and FMA it runs the kernel for 2 to 64 rows (decode steps; see MIN_ROWS, MAX_ROWS); the
program lowers to XLA's dot on any other platform it is compiled for (`platform_dependent`), and
GPU hosts never build the kernel.
The kernel is compiled with the system C++ compiler into `$IMP_JAX_HOME/kernels/`, named by a
hash of its source and the compiler, and loaded from there afterwards. Set IMP_JAX_CPU_GEMM=xla
to use XLA's dot on the CPU too.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp

from imp_jax.model.hub import imp_jax_home

log = logging.getLogger(__name__)

TARGET = "imp_gemm_f32"
MIN_ROWS = 2         # one row is a memory-bound GEMV, where XLA's dot already streams at full bandwidth
MAX_ROWS = 64        # above this XLA's own GEMM (which packs the weights, amortised over many rows) is faster
SOURCE = Path(__file__).with_name("cpu_gemm.cc")
_lock = threading.Lock()
_state: dict[str, object] = {}


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _build(cxx: str) -> Path:
    """Compile cpu_gemm.cc (once per source and compiler) and return the shared library's path."""
    source = SOURCE.read_bytes()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(source + version.encode() + jax.ffi.include_dir().encode()).hexdigest()[:16]
    lib = imp_jax_home() / "kernels" / f"cpu_gemm-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    log.info("compiling the CPU GEMM kernel with %s -> %s", cxx, lib)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = Path(tmp) / lib.name
        cmd = [cxx, "-O3", "-std=c++17", "-mavx2", "-mfma", "-shared", "-fPIC",
               "-I", jax.ffi.include_dir(), str(SOURCE), "-o", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(out, lib)   # atomic: a concurrent process sees no half-written library
    return lib


def available() -> bool:
    """Whether the kernel is built, loaded and registered for this CPU (built on the first call)."""
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _load()
        return bool(_state["ok"])


def _load() -> bool:
    if os.environ.get("IMP_JAX_CPU_GEMM", "auto").lower() == "xla":
        log.info("CPU GEMM kernel off (IMP_JAX_CPU_GEMM=xla): using XLA's dot")
        return False
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    cxx = _compiler()
    if cxx is None:
        log.warning("no C++ compiler found: the CPU GEMM kernel is off, using XLA's dot")
        return False
    try:
        lib = ctypes.CDLL(str(_build(cxx)))
    except (OSError, RuntimeError) as e:
        log.warning("CPU GEMM kernel unavailable, using XLA's dot: %s", e)
        return False
    if not lib.imp_gemm_cpu_supported():
        log.info("this CPU lacks AVX2/FMA: using XLA's dot")
        return False
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.ImpGemmF32), platform="cpu")
    _state["lib"] = lib   # keep the library loaded
    return True


def _kernel(x: jax.Array, w: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct(x.shape[:-1] + w.shape[:1], jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(x, w)


def _xla(x: jax.Array, w: jax.Array) -> jax.Array:
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def matmul_wt(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w.T for w [N, K], accumulated and returned in float32: the kernel for float32
    operands of MIN_ROWS to MAX_ROWS rows on CPUs that have it, XLA's dot otherwise."""
    rows = math.prod(x.shape[:-1])
    if (x.dtype != jnp.float32 or w.dtype != jnp.float32 or w.ndim != 2 or not MIN_ROWS <= rows <= MAX_ROWS
            or jax.default_backend() != "cpu" or not available()):
        return _xla(x, w)
    return jax.lax.platform_dependent(x, w, cpu=_kernel, default=_xla)
