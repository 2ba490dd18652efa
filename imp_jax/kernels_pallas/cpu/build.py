"""Build and load the C++ CPU kernels (`*.cc` next to this file) that XLA calls through its FFI.

Each kernel library is compiled once with the system C++ compiler ($CXX, else g++, c++ or clang++) into
`$IMP_JAX_HOME/kernels/cpu_<name>-<hash>.so`, the hash covering its sources, the headers next to
them that they include, the flags, the compiler and JAX's FFI headers, and loaded from there
afterwards (its SHA-256, recorded next to it at build time, checked before every load). Processes
that want the same library at once take turns on a file lock next to it: one compiles, the rest load. A
library of several translation units (`SOURCES`) compiles them in parallel, one compiler process
per CPU core across all builds (`_slots`), then links them. `prebuild` starts the libraries a server
will ask for on background threads, so they build while the model is fetched and opened.
They need x86-64 with AVX2, FMA and F16C; everywhere else, and whenever the build fails,
`load` returns None and the caller uses XLA (the reason is logged). A loaded library and its FFI
registration belong to the process, so they are remembered per process (`_libraries`,
`_registered`), each library behind its own lock (two libraries build at once).
`python -m imp_jax.kernels_pallas.cpu.build` is the install step (README): it builds now the libraries a
default start loads (`--all`: every one, for an image layer).
This module does not import jax until it registers a handler: the server starts the builds
(`start_early`) before its own jax import, which then runs beside the compiler.
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import importlib.util
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Iterator

import jaxlib

from imp_jax.paths import UnsafePathError, check_safe, kernels_dir, private_dir

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-std=c++17", "-mavx2", "-mfma", "-mf16c")
# The GEMM kernel's float sums are specified operation by operation (a row's bits must not depend on
# which of its code paths computed it: gemm_q8.h), so the compiler may not fuse a multiply and an add.
KERNEL_FLAGS = {"gemm": ("-ffp-contract=off",), "gemm_q8": ("-ffp-contract=off",)}
# each library's translation units; the GEMM's exact formats are two (gemm_exact.h), its int8-activation
# path (`--gemm cpu_q8`, auto's choice for a quantised GGUF) a library of its own, LoRA's too (opt-in)
SOURCES = {"attention": ("attention.cc",), "gemm": ("gemm.cc", "gemm_k.cc"), "gemm_q8": ("gemm_q8.cc",),
           "lora": ("lora.cc",)}
_lock = threading.Lock()
_library_locks: dict[str, threading.Lock] = {}
_libraries: dict[str, ctypes.CDLL | None] = {}
_registered: dict[str, bool] = {}
_slots = threading.BoundedSemaphore(max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                        else os.cpu_count() or 1))   # compiler processes at once


def cpu_libraries(attention: str, gemm: str, lora: bool) -> list[str]:
    """The kernel libraries a CPU engine with these settings (--attention, --gemm, --max-loras) may load:
    what `prebuild` starts while the model is fetched and opened (`auto`: gemm_q8 too, which a quantised
    GGUF will want, before the model says whether it is one)."""
    names = (["attention"] if attention in ("auto", "cpu") else []) + (["gemm"] if gemm in ("auto", "exact", "cpu_q8") else [])
    return names + (["gemm_q8"] if gemm in ("auto", "cpu_q8") else []) + (["lora"] if lora else [])


def start_early(attention: str, gemm: str, lora: bool) -> list[threading.Thread]:
    """`prebuild` the libraries an engine with these settings will ask for, before jax is imported, where
    that engine will run on this CPU: JAX_PLATFORMS names cpu first, or no JAX device plugin (CUDA, ROCm)
    is installed. Where that guess is wrong the libraries are built for nothing, on background threads."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    if platforms:
        on_cpu = platforms.split(",")[0].strip() == "cpu"
    else:
        on_cpu = not list(metadata.entry_points(group="jax_plugins")) and importlib.util.find_spec("jax_plugins") is None
    return prebuild(cpu_libraries(attention, gemm, lora)) if on_cpu else []


def include_dir() -> str:
    """jaxlib's bundled headers (XLA's FFI), where `jax.ffi.include_dir()` finds them, without importing jax."""
    return os.path.join(os.path.dirname(os.path.abspath(jaxlib.__file__)), "include")


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _build(name: str, cxx: str) -> Path:
    """Compile library `name` (once per source and compiler) and return the shared library's path."""
    here = Path(__file__).parent
    sources = [here / s for s in SOURCES[name]]
    source = b"".join(f.read_bytes() for f in _with_headers(sources))
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    flags = (*FLAGS, *KERNEL_FLAGS.get(name, ()))
    key = hashlib.sha256(source + version.encode() + " ".join(flags).encode()
                         + include_dir().encode()).hexdigest()[:16]
    lib = kernels_dir() / f"cpu_{name}-{key}.so"
    private_dir(lib.parent)
    with _build_lock(lib, name):
        if lib.exists():
            if verified(lib):
                return lib
            log.warning("%s has no build hash recorded next to it, or does not match it: rebuilding it", lib)
        return _compile(name, cxx, flags, sources, lib)


def _with_headers(sources: list[Path]) -> list[Path]:
    """`sources` and the headers next to them that they include, directly or through each other (`#include
    "x.h"`), each once, in a fixed order: what a library's build hash covers, so a header one library
    includes does not rebuild the others."""
    seen: list[Path] = []
    todo = list(sources)
    while todo:
        f = todo.pop(0)
        if f in seen:
            continue
        seen.append(f)
        for included in re.findall(r'^\s*#include\s+"([^"]+)"', f.read_text(), re.MULTILINE):
            if (f.parent / included).is_file():   # not jaxlib's (xla/ffi/...): include_dir() is in the hash
                todo.append(f.parent / included)
    return seen


@contextlib.contextmanager
def _build_lock(lib: Path, name: str) -> Iterator[None]:
    """Hold `lib`'s build lock (a file lock next to it), so that of the processes that start at once (two
    servers, test workers) one compiles and the others wait for its library instead of compiling it again."""
    with open(lib.with_suffix(".lock"), "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is building the %s kernel: waiting for it", name)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _compile(name: str, cxx: str, flags: tuple[str, ...], sources: list[Path], lib: Path) -> Path:
    log.info("compiling the %s kernel with %s -> %s", name, cxx, lib)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = Path(tmp) / lib.name
        objects = [Path(tmp) / f"{s.stem}.o" for s in sources]
        compile_ = [[cxx, *flags, "-fPIC", "-c", "-I", include_dir(), str(s), "-o", str(o)]
                    for s, o in zip(sources, objects)]
        with ThreadPoolExecutor(len(compile_)) as pool:
            list(pool.map(_run_compiler, compile_))
        _run_compiler([cxx, "-shared", *map(str, objects), "-o", str(out)])
        digest = out.with_suffix(".sha256")
        digest.write_text(_sha256(out))
        os.replace(digest, _digest_path(lib))
        os.replace(out, lib)   # atomic: a concurrent process sees no half-written library
    return lib


def _run_compiler(cmd: list[str]) -> None:
    """One compiler process, when a slot is free; RuntimeError with its output when it fails."""
    with _slots:
        done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")


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
    """The kernel library `name` built for and runnable on this CPU, or None (built on first call;
    a call while another thread builds it waits for that build)."""
    with _lock:
        lock = _library_locks.setdefault(name, threading.Lock())
    with lock:
        if name not in _libraries:
            _libraries[name] = _load(name)
        return _libraries[name]


def prebuild(names: list[str]) -> list[threading.Thread]:
    """Start building (and loading) the libraries `names` on background threads, at once and in
    parallel; `load` and `register` then wait for them instead of compiling."""
    threads = [threading.Thread(target=load, args=(name,), name=f"imp-kernel-{name}", daemon=True)
               for name in names if name not in _libraries]
    for t in threads:
        t.start()
    return threads


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
                import jax
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, handler)), platform="cpu")
            _registered[target] = lib is not None
        return _registered[target]


def main(argv: list[str] | None = None) -> int:
    """The install step (`python -m imp_jax.kernels_pallas.cpu.build`, README): build now the libraries a
    default CPU server loads (`--all`: every one, e.g. for an image layer), one line per library. A
    machine that cannot run them (not x86-64, no compiler, a failed build: the server then uses XLA)
    is reported and exits 0, so the install command goes on to start the server; `--strict` makes it 1."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m imp_jax.kernels_pallas.cpu.build", description=main.__doc__)
    parser.add_argument("--all", action="store_true", help="every library, the opt-in one (lora) too")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a library is unavailable")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    names = list(SOURCES) if args.all else cpu_libraries("auto", "auto", lora=False)
    t0 = time.perf_counter()
    for t in prebuild(names):
        t.join()
    for name in names:
        print(f"{name}: {'ready' if _libraries.get(name) is not None else 'unavailable, the server uses XLA (see the log)'}")
    print(f"CPU kernels: {sum(_libraries.get(n) is not None for n in names)} of {len(names)} ready "
          f"in {time.perf_counter() - t0:.1f}s ({kernels_dir()})")
    return 1 if args.strict and not all(_libraries.get(name) is not None for name in names) else 0


if __name__ == "__main__":
    sys.exit(main())
