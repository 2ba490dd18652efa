"""Build and load the C++ CPU kernels (`*.cc` next to this file) that XLA calls through its FFI.

Each kernel is compiled once with the system C++ compiler ($CXX, else g++, c++ or clang++) into
`$IMP_JAX_HOME/kernels/cpu_<name>-<hash>.so`, the hash covering its source, the headers next to it
(`*.h`, which it may include), the compiler and JAX's FFI headers, and loaded from there
afterwards. They need x86-64 with AVX2, FMA and F16C; everywhere else, and whenever the build fails,
`load` returns None and the caller uses XLA (the reason is logged). A loaded library and its FFI
registration belong to the process, so they are remembered per process (`_libraries`,
`_registered`), behind a lock.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax

from imp_jax.paths import UnsafePathError, check_safe, kernels_dir, private_dir

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-std=c++17", "-mavx2", "-mfma", "-mf16c")
# The GEMM kernel's float sums are specified operation by operation (a row's bits must not depend on
# which of its code paths computed it: gemm_q8.h), so the compiler may not fuse a multiply and an add.
KERNEL_FLAGS = {"gemm": ("-ffp-contract=off",)}
_lock = threading.Lock()
_libraries: dict[str, ctypes.CDLL | None] = {}
_registered: dict[str, bool] = {}


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _build(name: str, cxx: str) -> Path:
    """Compile `name`.cc (once per source and compiler) and return the shared library's path."""
    source_path = Path(__file__).with_name(f"{name}.cc")
    source = source_path.read_bytes() + b"".join(h.read_bytes() for h in sorted(source_path.parent.glob("*.h")))
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    flags = (*FLAGS, *KERNEL_FLAGS.get(name, ()))
    key = hashlib.sha256(source + version.encode() + " ".join(flags).encode()
                         + jax.ffi.include_dir().encode()).hexdigest()[:16]
    lib = kernels_dir() / f"cpu_{name}-{key}.so"
    private_dir(lib.parent)
    if lib.exists():
        if verified(lib):
            return lib
        log.warning("%s has no build hash recorded next to it, or does not match it: rebuilding it", lib)
    log.info("compiling the %s kernel with %s -> %s", name, cxx, lib)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = Path(tmp) / lib.name
        cmd = [cxx, *flags, "-shared", "-fPIC", "-I", jax.ffi.include_dir(), str(source_path), "-o", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        digest = out.with_suffix(".sha256")
        digest.write_text(_sha256(out))
        os.replace(digest, _digest_path(lib))
        os.replace(out, lib)   # atomic: a concurrent process sees no half-written library
    return lib


def verified(lib: Path) -> bool:
    """Whether `lib` is safe to load: owned by this user, not writable by others (else UnsafePathError),
    and its SHA-256 the one recorded next to it when this server built it (else False: rebuild)."""
    check_safe(lib)
    digest = _digest_path(lib)
    if not digest.is_file():
        return False
    check_safe(digest)
    return digest.read_text().strip() == _sha256(lib)


def _digest_path(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sha256")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load(name: str) -> ctypes.CDLL | None:
    """The kernel library `name` built for and runnable on this CPU, or None (built on first call)."""
    with _lock:
        if name not in _libraries:
            _libraries[name] = _load(name)
        return _libraries[name]


def _load(name: str) -> ctypes.CDLL | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    cxx = _compiler()
    if cxx is None:
        log.warning("no C++ compiler found: the %s kernel is off, using XLA", name)
        return None
    try:
        lib = ctypes.CDLL(str(_build(name, cxx)))
    except UnsafePathError as e:
        log.error("%s kernel refused, using XLA: %s", name, e)
        return None
    except (OSError, RuntimeError) as e:
        log.warning("%s kernel unavailable, using XLA: %s", name, e)
        return None
    if not lib.imp_kernel_cpu_supported():
        log.info("this CPU lacks AVX2/FMA/F16C: the %s kernel is off, using XLA", name)
        return None
    return lib


def register(name: str, target: str, handler: str) -> bool:
    """Load kernel library `name` and register its FFI handler symbol as XLA CPU custom-call
    `target` (once); whether the kernel is there to call."""
    lib = load(name)
    with _lock:
        if target not in _registered:
            if lib is not None:
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, handler)), platform="cpu")
            _registered[target] = lib is not None
        return _registered[target]
